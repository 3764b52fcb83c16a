"""The longest modules named in tests/helpers/module_order.py exist, each named once: a
module renamed or removed would otherwise lose its place at the start of `make test`."""

from pathlib import Path

from tests.helpers.module_order import LONGEST


def test_every_module_named_longest_exists_once():
    tests = Path(__file__).parent
    assert len(set(LONGEST)) == len(LONGEST)
    assert [name for name in LONGEST if not (tests / f"{name}.py").is_file()] == []
