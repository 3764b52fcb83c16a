"""A script of ``scripts/`` imported as a module, so that tests can call its functions."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.helpers.vllm_engine import ROOT


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as the module ``<name>`` (registered in ``sys.modules``, where
    its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
