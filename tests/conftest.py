import pytest

from kvtier.layout import KVLayout
from tests.helpers.kv import SMALL
from tests.helpers.module_order import LONGEST


@pytest.fixture
def layout() -> KVLayout:
    return SMALL


@pytest.fixture(scope="session", autouse=True)
def _warm_engine_host():
    """The engine host of tests/helpers/vllm_engine.py ends with the session."""
    yield
    from tests.helpers.vllm_engine import close_warm_host

    close_warm_host()


def pytest_collection_modifyitems(config, items):
    """The longest modules first (``LONGEST``), each in its own order: with ``make test``'s
    workers (pytest-xdist, ``--dist loadscope --no-loadscope-reorder``, which keeps this
    order) they start first instead of holding the run's end."""
    rank = {name: i for i, name in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))
