"""Every name a script under scripts/ imports from kvtier exists: the benchmarks are run by
hand from docs/benchmarks.md, and a name moved to another module broke one unnoticed."""

import ast
import importlib
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))


def kvtier_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of each ``from kvtier... import name`` in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kvtier":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.startswith("kvtier")]
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_kvtier_name_a_script_imports_exists(script):
    for module, name in kvtier_imports(script):
        loaded = importlib.import_module(module)
        assert not name or hasattr(loaded, name) or _is_module(f"{module}.{name}"), (
            f"{script.name} imports {name} from {module}, which has no such name")


def _is_module(dotted: str) -> bool:
    try:
        importlib.import_module(dotted)
    except ImportError:
        return False
    return True
