"""``scripts/gpu_worker_check.py`` works before a GPU machine's time is spent on it: the
connector's worker, driven as vLLM's GPU model runner drives it, runs on the CPU (``--device
cpu --small``) in every layout, and its checks fail when a page copy is wrong."""

import json
import os
import subprocess
import sys

import pytest
import torch

from kvtier.connector.worker.pages import PagedKV
from tests.helpers.page_faults import off_by_one_byte, scatter_nothing
from tests.helpers.script_module import load_script
from tests.helpers.vllm_engine import ROOT

CPU = torch.device("cpu")


def test_the_gpu_run_passes_every_check_in_every_layout_as_a_dry_run_on_the_cpu(tmp_path):
    """``scripts/gpu_run.sh`` (what a GPU machine runs) with ``DRY_RUN=1``: both scripts, every
    layout, and the chunk sizes it asks for."""
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    out = tmp_path / "out"
    result = subprocess.run([str(ROOT / "scripts" / "gpu_run.sh"), str(out)], capture_output=True,
                            text=True, timeout=600, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checked = json.loads((out / "gpu_check.json").read_text())
    assert checked["store"]["identical"] and checked["store"]["demotions"] > 0
    assert checked["store"]["flushed"] and checked["store"]["reloaded_tokens_after_restart"] == 2048
    assert checked["pages"]["gather_identical"] and checked["pages"]["scatter_identical"]
    assert sorted(checked["layouts"]) == sorted(load_script("gpu_check").LAYOUTS)
    assert all(check["identical"] for check in checked["layouts"].values())
    script = load_script("gpu_worker_check")
    small = script.SMALL
    data = json.loads((out / "gpu_worker_check.json").read_text())
    assert sorted(data["cases"]) == sorted(f"{c.name}/{small.chunk_tokens}"
                                           for c in script.cases(small))
    for name, case in data["cases"].items():
        assert case["stores_identical"] and case["host_hits_identical"], name
        assert case["disk_hits_identical"], name
        assert case["chunks"] == small.requests * small.chunks, name
        # a hybrid model's loads are all asynchronous (vLLM takes back only those as failed)
        assert case["host_hits_asynchronous"] == name.startswith("hybrid"), name
        assert min(case["store_gib_s"], case["host_load_gib_s"], case["disk_load_gib_s"]) > 0
    chunks = json.loads((out / "gpu_worker_check_chunks.json").read_text())["cases"]
    assert sorted(chunks) == ["LBNHC/1024", "LBNHC/64", "MLA/1024", "MLA/64"]
    assert all(case["disk_hits_identical"] for case in chunks.values())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("kvtier-gpu-worker-")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check runs")
def test_without_a_gpu_the_default_run_says_so_and_exits_2():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_worker_check.py")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "no CUDA GPU" in result.stderr


def _checks(script, tmp_path, name):
    case = next(c for c in script.cases(script.SMALL) if c.name == name)
    out = script.run_case(case, script.SMALL, CPU, tmp_path, ceiling=False)
    return out["stores_identical"], out["host_hits_identical"], out["disk_hits_identical"]


@pytest.mark.parametrize("name", ["LBNHC", "hybrid"])
def test_a_wrong_byte_stored_fails_every_check_that_loads_it(monkeypatch, tmp_path, name):
    script = load_script("gpu_worker_check")
    monkeypatch.setattr(PagedKV, "gather", off_by_one_byte("gather"))
    assert _checks(script, tmp_path, name) == (False, False, False)


@pytest.mark.parametrize("name", ["LBNHC", "MLA", "hybrid"])
@pytest.mark.parametrize("fault", ["off by one byte", "nothing copied"])
def test_a_wrong_or_missing_load_fails_the_host_and_disk_checks(monkeypatch, tmp_path, name,
                                                                fault):
    script = load_script("gpu_worker_check")
    wrong = off_by_one_byte("scatter") if fault == "off by one byte" else scatter_nothing
    monkeypatch.setattr(PagedKV, "scatter", wrong)
    _, host, disk = _checks(script, tmp_path, name)
    assert not host and not disk


def test_without_fio_the_disk_is_measured_by_bare_reads(tmp_path, monkeypatch):
    script = load_script("gpu_worker_check")
    monkeypatch.setattr(script, "have_fio", lambda: False)  # a GPU machine's image lacks it
    out = script.disk_ceiling(tmp_path, 64 * 1024, 4 * 2**20)
    assert out["disk_ceiling"] == "bare reads" and out["disk_ceiling_gib_s"] > 0
    assert script.disk_ceiling(tmp_path, 64 * 1024 + 512, 4 * 2**20)["disk_ceiling"] is None
