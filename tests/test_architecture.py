"""The package plan holds: imports flow one way, from the engine adapters down to bytes, and
every file and function is short enough to read whole.

Each module belongs to the deepest layer whose prefix names it; a module may import only
modules of its own layer's packages or of layers below it, and no modules import each other
in a circle (``TYPE_CHECKING`` and function-level imports count: they are dependencies
too). docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvtier"

# Bottom first. Packages on one line are side by side and may not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("kvtier.errors", "kvtier.units"),
    ("kvtier.keys", "kvtier.metrics", "kvtier.logs"),
    ("kvtier.layout",),
    ("kvtier.config",),
    ("kvtier.io",),
    ("kvtier.tiers",),
    ("kvtier.segment",),
    ("kvtier.disk",),
    ("kvtier.shared",),
    ("kvtier.remote",),
    ("kvtier.store", "kvtier.ops"),
    ("kvtier.connector.common",),
    ("kvtier.connector.scheduler", "kvtier.connector.worker"),
    ("kvtier.connector",),
    ("kvtier.bench",),
    ("kvtier.cli",),
]
# ``import kvtier`` itself only names its version and loads its public names lazily.
ROOT_NAMES = {"__version__"}
TOP_LEVEL_MODULES_MAX = 8


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The kvtier modules ``path`` imports, anywhere in it (``from a import b`` names
    module ``a.b`` when that is one)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvtier"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.startswith("kvtier"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            if node.module == "kvtier":
                names = {a.name for a in node.names} - ROOT_NAMES
                found.update(subs)
                found.update("kvtier" for n in names if f"kvtier.{n}" not in known)
            else:
                found.update(subs or {node.module})
    return found


def unit_of(module: str) -> tuple[int, str]:
    """(layer, package) of ``module``: the longest layer prefix that names it."""
    best: tuple[int, str] | None = None
    for rank, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and \
                    (best is None or len(prefix) > len(best[1])):
                best = (rank, prefix)
    assert best is not None, f"{module} is in no layer: add its package to LAYERS"
    return best


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(p, known) - {m} for m, p in mods.items()}


def test_every_module_sits_in_a_layer():
    for module in modules():
        if module != "kvtier":
            unit_of(module)


def test_imports_flow_downward_only():
    upward = []
    for module, deps in graph().items():
        if module == "kvtier":
            continue
        rank, unit = unit_of(module)
        for dep in deps:
            assert dep != "kvtier", f"{module} imports kvtier's lazy public names: import the module"
            dep_rank, dep_unit = unit_of(dep)
            if dep_rank > rank or (dep_rank == rank and dep_unit != unit):
                upward.append(f"{module} -> {dep}")
    assert not upward, "imports that run upward or sideways:\n" + "\n".join(sorted(upward))


def test_no_modules_import_each_other_in_a_circle():
    edges = graph()
    state: dict[str, int] = {}
    circles: list[str] = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for dep in sorted(edges.get(module, ())):
            if state.get(dep) == 1:
                circles.append(" -> ".join([*trail[trail.index(dep):], dep]))
            elif dep not in state:
                visit(dep, [*trail, dep])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_top_level_holds_only_the_public_surface():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MODULES_MAX, top


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from kvtier.store.kvstore import KVStore\n")
    deps = imports_of(bad, set(modules()))
    assert deps == {"kvtier.store.kvstore"}
    assert unit_of("kvtier.io.buffers")[0] < unit_of("kvtier.store.kvstore")[0]


@pytest.mark.parametrize("module", ["kvtier.connector.scheduler.side", "kvtier.store.kvstore"])
def test_layers_name_real_packages(module):
    assert module in modules()


MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 40


def test_no_file_and_no_function_is_too_long_to_read_whole():
    too_long = []
    for module, path in modules().items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1 if node.end_lineno else 0
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{module}.{node.name}: {lines} lines")
    assert not too_long, (f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a "
                          "function:\n" + "\n".join(too_long))


def test_the_architecture_doc_names_every_module():
    """docs/architecture.md's tables name every module (an ``__init__`` holding only its
    docstring aside), and every module path it names exists."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(kvtier/[\w/]+\.py)`", doc))
    paths = {str(p.relative_to(PACKAGE.parent)) for p in modules().values()
             if p.name != "__init__.py" or ast.parse(p.read_text()).body[1:]}
    assert not paths - named, f"modules docs/architecture.md does not name: {sorted(paths - named)}"
    gone = sorted(p for p in named if not (PACKAGE.parent / p).exists())
    assert not gone, f"modules docs/architecture.md names that do not exist: {gone}"
