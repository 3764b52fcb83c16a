"""Helpers live in tests/helpers/: no file under tests/ imports from a test module
(``tests.test_*``) or from ``tests.conftest``, which keeps only fixtures and hooks."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def forbidden(module: str) -> bool:
    """Whether importing ``module`` reaches into a test module or the conftest."""
    parts = module.split(".")
    return len(parts) >= 2 and parts[0] == "tests" and (
        parts[1].startswith("test_") or parts[1] == "conftest")


def imports_from_tests(path: Path) -> list[str]:
    """``path:line: module`` for each import of a test module or of the conftest in ``path``
    (of ``tests.test_x`` or ``tests.conftest``: ``import``, ``from ... import``, ``from tests
    import test_x``, at module level or inside a function)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == "tests":
                modules += [f"tests.{alias.name}" for alias in node.names]
        else:
            continue
        found += [f"{path}:{node.lineno}: {module}" for module in modules if forbidden(module)]
    return found


def test_no_file_under_tests_imports_from_a_test_module_or_the_conftest():
    files = sorted(TESTS.rglob("*.py"))
    assert TESTS / "helpers" / "kv.py" in files
    found = [hit for path in files for hit in imports_from_tests(path)]
    assert found == [], "import helpers from tests/helpers/ instead:\n" + "\n".join(found)


def test_the_check_catches_imports_from_test_modules_and_the_conftest(tmp_path):
    bad = tmp_path / "test_bad.py"
    tests = "tests"  # spelled apart, so that a grep of the suite for such imports stays empty
    bad.write_text("import os\n"
                   f"from {tests}.test_disk_store import config\n"
                   f"import {tests}.test_cli\n"
                   f"from {tests} import conftest\n"
                   "\n"
                   "def test_x():\n"
                   f"    from {tests}.conftest import SMALL\n")
    assert imports_from_tests(bad) == [f"{bad}:2: tests.test_disk_store", f"{bad}:3: tests.test_cli",
                                       f"{bad}:4: tests.conftest", f"{bad}:7: tests.conftest"]
    good = tmp_path / "test_good.py"
    good.write_text("from tests.helpers.store import config\nfrom tests.helpers import kv\n"
                    "import tests.helpers.cli\nfrom kvtier import test_utils\n")
    assert imports_from_tests(good) == []
