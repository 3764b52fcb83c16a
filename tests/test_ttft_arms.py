"""``scripts/ttft.py --arms``: which engine runs a TTFT benchmark starts."""

import subprocess
import sys

import pytest

from tests.helpers.script_module import load_script
from tests.helpers.vllm_engine import ROOT


def test_every_arm_runs_by_default_and_a_hit_from_disk_brings_the_store_it_loads():
    ttft = load_script("ttft")
    assert ttft.chosen_arms(",".join(ttft.ARMS)) == set(ttft.ARMS)
    assert ttft.chosen_arms("kvtier-disk") == {"kvtier-disk", "kvtier-host"}
    assert ttft.chosen_arms("kvtier-shared, example") == {"kvtier-shared", "kvtier-host", "example"}
    assert ttft.chosen_arms("") == set()  # recompute alone (with --remote: and the remote arm)


def test_an_unknown_arm_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown arm.*kvtier-dsk.*choose from vllm-prefix"):
        load_script("ttft").chosen_arms("kvtier-dsk")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "ttft.py"), "--arms", "nope"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "unknown arm(s) nope" in result.stderr
