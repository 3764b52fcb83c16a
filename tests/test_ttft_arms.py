"""``scripts/ttft.py --arms``: which engine runs a TTFT benchmark starts."""

import importlib.util
import subprocess
import sys

import pytest

from tests.vllm_engine import ROOT


def _ttft():
    spec = importlib.util.spec_from_file_location("ttft_script", ROOT / "scripts" / "ttft.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_arm_runs_by_default_and_a_hit_from_disk_brings_the_store_it_loads():
    ttft = _ttft()
    assert ttft.chosen_arms(",".join(ttft.ARMS)) == set(ttft.ARMS)
    assert ttft.chosen_arms("kvtier-disk") == {"kvtier-disk", "kvtier-host"}
    assert ttft.chosen_arms("kvtier-shared, example") == {"kvtier-shared", "kvtier-host", "example"}
    assert ttft.chosen_arms("") == set()  # recompute alone (with --remote: and the remote arm)


def test_an_unknown_arm_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown arm.*kvtier-dsk.*choose from vllm-prefix"):
        _ttft().chosen_arms("kvtier-dsk")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "ttft.py"), "--arms", "nope"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "unknown arm(s) nope" in result.stderr
