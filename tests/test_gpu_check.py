"""``scripts/gpu_check.py`` works before a GPU machine's time is spent on it: its checks run
on the CPU (``--device cpu --small``) and fail when a page copy is wrong."""

import json
import subprocess
import sys

import pytest
import torch

from kvtier.connector.worker.pages import PagedKV
from tests.helpers.page_faults import off_by_one_byte
from tests.helpers.script_module import load_script
from tests.helpers.vllm_engine import ROOT

CPU = torch.device("cpu")


def test_a_dry_run_on_the_cpu_passes_every_check(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device",
                             "cpu", "--small", "--json", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["store"]["identical"] and data["store"]["demotions"] > 0
    assert data["store"]["flushed"] and data["store"]["reloaded_tokens_after_restart"] == 2048
    assert data["pages"]["gather_identical"] and data["pages"]["scatter_identical"]
    assert sorted(data["layouts"]) == sorted(load_script("gpu_check").LAYOUTS)
    assert all(check["identical"] for check in data["layouts"].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check runs")
def test_without_a_gpu_the_default_run_says_so_and_exits_2():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "no CUDA GPU" in result.stderr


@pytest.mark.parametrize("method", ["gather", "scatter"])
def test_a_wrong_page_copy_fails_the_checks(monkeypatch, method):
    script = load_script("gpu_check")
    monkeypatch.setattr(PagedKV, method, off_by_one_byte(method))
    pages = script.pages_check(CPU, script.SMALL)
    assert not (pages["gather_identical"] and pages["scatter_identical"])
    layouts = script.layouts_check(CPU, script.SMALL)
    assert not any(check["identical"] for check in layouts.values())
