"""``scripts/gpu_check.py`` works before a GPU machine's time is spent on it: its checks fail
when a page copy is wrong (its dry run on the CPU, through ``scripts/gpu_run.sh``, is in
``tests/test_gpu_worker_check.py``)."""

import subprocess
import sys

import pytest
import torch

from kvtier.connector.worker.pages import PagedKV
from tests.helpers.page_faults import off_by_one_byte
from tests.helpers.script_module import load_script
from tests.helpers.vllm_engine import ROOT

CPU = torch.device("cpu")


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
