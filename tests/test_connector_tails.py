"""Prompt tails on the scheduler side: a prompt's partial last chunk is stored once the
prompt is computed and matched only by an identical prompt, which then loads all but its
last token; loads cover the last block partly."""

import dataclasses
import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from kvtier.connector.common.messages import StepPlan, WorkerReport
from kvtier.connector.scheduler.tails import prompt_tail
from tests.helpers.scheduler_side import BLOCK, CHUNK, GEO, scheduler


@dataclass
class Prompt:
    """A stand-in for vLLM's Request, with a prompt (block hashes chained over it)."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    mm_features: list = field(default_factory=list)
    outputs: int = 0  # tokens generated (a preempted request coming back)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.outputs

    @property
    def block_hashes(self) -> list[bytes]:
        hashes, parent = [], (self.cache_salt or "").encode()
        tokens = self.prompt_token_ids + [0] * self.outputs
        for b in range(len(tokens) // BLOCK):
            block = str(tokens[b * BLOCK:(b + 1) * BLOCK]).encode()
            parent = hashlib.blake2b(parent + block, digest_size=32).digest()
            hashes.append(parent)
        return hashes


def prompt(name: str, length: int, seed: int = 0, **extra) -> Prompt:
    return Prompt(name, [(seed * 7919 + i * 31) % 30000 for i in range(length)], **extra)


def blocks(length: int) -> tuple[list[int], ...]:
    return (list(range(100, 100 + -(-length // BLOCK))),)


def store(side, req: Prompt) -> StepPlan:
    """The request's prompt computed in one step, its stores reported done."""
    meta = StepPlan()
    assert side.completes_chunks(req.request_id, req.num_tokens) or req.num_tokens < CHUNK
    side.plan_stores(req, blocks(req.num_tokens), req.num_tokens, meta)
    side.worker_report(WorkerReport(host_stored=Counter({s.key: 1 for s in meta.stores})))
    return meta


@pytest.mark.parametrize("length", [10, 16, 40, 48, 75])  # short of a block, between blocks...
def test_a_repeated_prompt_loads_all_but_its_last_token(length):
    side = scheduler(host_capacity=8 * GEO.chunk_bytes)
    meta = store(side, prompt("a", length))
    tail = meta.stores[-1]
    assert tail.key == prompt_tail(prompt("x", length), GEO, side.keys.namespace).key
    full = length // CHUNK
    first = full * CHUNK // BLOCK
    assert tail.block_ids == tuple(range(100 + first, 100 + -(-length // BLOCK)))
    assert side.num_new_matched_tokens(prompt("b", length), 0) == (length - 1, False)
    side.plan_load(prompt("b", length), blocks(length), 0, length - 1)
    (load,) = side.build_meta().loads
    assert [c.key for c in load.chunks][-1] == tail.key
    # the blocks holding tokens 0 .. length - 2: the last one partly
    assert [b for c in load.chunks for b in c.block_ids] == list(range(100, 100 + -(-(length - 1) // BLOCK)))


@pytest.mark.parametrize("length", [2 * CHUNK, 2 * CHUNK + 1])
def test_a_prompt_on_a_chunk_boundary_has_no_tail_and_loads_all_but_its_last_token(length):
    side = scheduler()
    meta = store(side, prompt("a", length))
    assert len(meta.stores) == 2  # a tail of one token would be the token vLLM computes
    assert side.num_new_matched_tokens(prompt("b", length), 0) == (length - 1, False)


def test_a_tail_matches_only_an_identical_prompt():
    side = scheduler(host_capacity=8 * GEO.chunk_bytes)
    store(side, prompt("a", 40))
    changed = prompt("b", 40)
    changed.prompt_token_ids[-1] += 1
    longer = prompt("c", 40)
    longer.prompt_token_ids += [5] * 10
    shorter = prompt("d", 40)
    shorter.prompt_token_ids = shorter.prompt_token_ids[:39]
    salted = prompt("e", 40, cache_salt="tenant-b")
    for other in (changed, longer, shorter):  # only the full chunk
        assert side.num_new_matched_tokens(other, 0) == (CHUNK, False)
    assert side.num_new_matched_tokens(salted, 0) == (0, False)


def test_where_the_engine_cannot_go_on_from_a_partial_hit_only_whole_prompts_are_loaded():
    """vLLM's reference MLA backend on the CPU (``reference_cpu_mla``): a hit must leave one
    token, a decode; a prompt sharing only a prefix with a stored one computes it all."""
    side = scheduler(host_capacity=8 * GEO.chunk_bytes,
                     geometry=dataclasses.replace(GEO, reference_cpu_mla=True))
    store(side, prompt("a", 40))
    store(side, prompt("b", 2 * CHUNK, seed=1))
    assert side.num_new_matched_tokens(prompt("c", 40), 0) == (39, False)
    assert side.num_new_matched_tokens(prompt("d", 2 * CHUNK, seed=1), 0) == (2 * CHUNK - 1, False)
    longer, changed = prompt("e", 40), prompt("f", 40)
    longer.prompt_token_ids += [5] * 10
    changed.prompt_token_ids[-1] += 1
    for other in (longer, changed):  # the first chunk is found: it is not loaded
        assert side.num_new_matched_tokens(other, 0) == (0, False)
    assert side.num_new_matched_tokens(prompt("g", 2 * CHUNK + 8, seed=1), 0) == (0, False)


def test_a_short_prompt_with_another_salt_misses():
    side = scheduler()
    store(side, prompt("a", 10, cache_salt="one"))
    assert side.num_new_matched_tokens(prompt("b", 10, cache_salt="one"), 0) == (9, False)
    assert side.num_new_matched_tokens(prompt("c", 10, cache_salt="two"), 0) == (0, False)
    assert side.num_new_matched_tokens(prompt("d", 10), 0) == (0, False)


def test_a_multimodal_prompt_has_no_tail():
    side = scheduler()
    meta = store(side, prompt("a", 40, mm_features=["image"]))
    assert len(meta.stores) == 1  # the full chunk only
    assert side.num_new_matched_tokens(prompt("b", 40, mm_features=["image"]), 0) == (CHUNK, False)


def test_a_request_past_its_prompt_loads_no_more_of_its_tail_than_the_prompt():
    side = scheduler(host_capacity=8 * GEO.chunk_bytes)
    store(side, prompt("a", 40))
    back = prompt("b", 40, outputs=5)  # preempted after 5 tokens: its tail chunk is not full
    assert side.num_new_matched_tokens(back, 0) == (40, False)


def test_a_tail_is_offered_once_the_prompt_is_computed_and_stored_once():
    side = scheduler(host_capacity=8 * GEO.chunk_bytes)
    req = prompt("a", 40)
    meta = StepPlan()
    side.plan_stores(req, blocks(40), 32, meta)  # a chunked prefill: the first 32 tokens
    assert len(meta.stores) == 1
    assert side.completes_chunks("a", 40)
    later = StepPlan()
    side.plan_stores(req, blocks(40), 40, later)
    assert len(later.stores) == 1 and later.stores[0].block_ids == (102,)
    assert not side.completes_chunks("a", 41)  # decode steps: nothing more to store


def test_chunks_and_a_tail_a_request_finished_without_a_host_slot_for_are_counted():
    side = scheduler()  # 4 host slots
    holder = prompt("holder", 4 * CHUNK, seed=1)
    held = StepPlan()
    side.plan_stores(holder, blocks(4 * CHUNK), 4 * CHUNK, held)  # stores in flight: all 4
    req = prompt("a", 2 * CHUNK + 8, seed=2)  # two chunks and a tail
    for computed in (2 * CHUNK + 8, 2 * CHUNK + 9, 2 * CHUNK + 10):  # its prompt, 2 decodes
        assert side.completes_chunks("a", computed)
        meta = StepPlan()
        side.plan_stores(req, blocks(computed), computed, meta)
        assert meta.stores == []  # no host slot free: offered again at its next step
    side.request_finished("a")
    assert side.counters["store_no_room_chunks"] == 3
    side.worker_report(WorkerReport(host_stored=Counter({s.key: 1 for s in held.stores})))
    side.request_finished("holder")  # stored every chunk: none counted
    late = prompt("b", 2 * CHUNK + 8, seed=3)
    side.plan_stores(late, blocks(CHUNK), CHUNK, StepPlan())  # its first chunk, then room
    side.request_finished("b")  # ended in its prefill: only what it computed counts
    assert side.counters["store_no_room_chunks"] == 3
    drafts = prompt("c", 2 * CHUNK, seed=4)  # both chunks stored, then a step with drafts
    side.plan_stores(drafts, blocks(2 * CHUNK), 2 * CHUNK, StepPlan())
    side.plan_stores(drafts, blocks(3 * CHUNK), 2 * CHUNK + CHUNK, StepPlan())  # 1 + 31 drafts
    side.request_finished("c")  # no third chunk: vLLM kept (and hashed) none of it
    assert side.counters["store_no_room_chunks"] == 3


def test_a_loads_tokens_are_counted_by_the_tier_they_come_from(tmp_path):
    from kvtier.tiers.base import TierName

    side = scheduler(disk=tmp_path, disk_slots=8, host_capacity=8 * GEO.chunk_bytes)
    meta = store(side, prompt("a", 40))
    side.worker_report(WorkerReport(disk_written=Counter({s.key: 1 for s in meta.stores})))
    side.stack.indexes[TierName.HOST].discard(meta.stores[-1].key)  # the tail: on disk only
    assert side.num_new_matched_tokens(prompt("b", 40), 0) == (39, True)
    side.plan_load(prompt("b", 40), blocks(40), 0, 39)
    assert side.load_tiers("b", 39) == {TierName.HOST: CHUNK, TierName.DISK: 39 - CHUNK}


def test_a_short_prompts_tail_is_keyed_by_its_adapters_name_and_path_not_its_id():
    from types import SimpleNamespace

    def key(**lora):
        req = prompt("a", 10)
        req.lora_request = SimpleNamespace(**lora)
        return prompt_tail(req, GEO, scheduler().keys.namespace).key

    base = key(lora_name="sql", lora_path="/a/v1", lora_int_id=1)
    assert key(lora_name="sql", lora_path="/a/v1", lora_int_id=7) == base  # another process
    assert key(lora_name="sql", lora_path="/a/v2", lora_int_id=1) != base  # re-pointed
    assert key(lora_name="text", lora_path="/a/v1", lora_int_id=1) != base
    assert prompt_tail(prompt("a", 10), GEO, scheduler().keys.namespace).key != base


def test_a_prompt_that_grows_in_its_session_offers_its_new_tail():
    side = scheduler(host_capacity=8 * GEO.chunk_bytes)
    req = prompt("a", 40)
    first = store(side, req)
    req.prompt_token_ids += [7] * 10  # a streaming session's next input, same request
    assert side.completes_chunks("a", 50)
    meta = StepPlan()
    side.plan_stores(req, blocks(50), 50, meta)
    (tail,) = meta.stores
    assert tail.key != first.stores[-1].key and tail.block_ids == (102, 103)
    assert tail.key == prompt_tail(prompt("x", 40).__class__("x", req.prompt_token_ids), GEO,
                                   side.keys.namespace).key


def test_remote_presence_asks_again_when_a_requests_keys_change():
    from kvtier.connector.scheduler.remote_presence import RemotePresence

    class Store:
        down, asked = False, []

        def exists(self, keys):
            self.asked.append(list(keys))
            return [k == b"full" for k in keys]

        def exists_answered(self, keys):
            held = self.exists(keys)
            return None if self.down else held

        def close(self):
            pass

    store_ = Store()
    presence = RemotePresence([store_], wait_s=5)
    try:
        deadline = time.monotonic() + 5
        while presence.held("r", [b"a", b"tail"]) is None:
            assert time.monotonic() < deadline
        while (found := presence.held("r", [b"a", b"full"])) is None:  # the tail gave way
            assert time.monotonic() < deadline
        assert found == [False, True] and len(store_.asked) == 2
        assert presence.held("r", [b"a"]) == [False] and len(store_.asked) == 2  # a prefix
    finally:
        presence.close()


def test_a_sampled_requests_cached_tail_is_checked_on_its_full_blocks():
    side = scheduler(host_capacity=8 * GEO.chunk_bytes, verify_sample=1)
    stored = store(side, prompt("a", 2 * CHUNK + BLOCK + 10))  # a tail of one block and 10
    again = prompt("b", 2 * CHUNK + BLOCK + 10)
    assert side.num_new_matched_tokens(again, 0) == (0, False)  # sampled: computed
    meta = StepPlan()
    side.plan_stores(again, blocks(again.num_tokens), again.num_tokens, meta)
    assert [v.source.key for v in meta.verifies] == [s.key for s in stored.stores]
    assert [v.blocks for v in meta.verifies] == [None, None, 1] and not meta.stores
    short = scheduler(host_capacity=8 * GEO.chunk_bytes, verify_sample=1)
    store(short, prompt("c", 2 * CHUNK + 10))  # a tail shorter than a block: not checked
    meta = StepPlan()
    again = prompt("d", 2 * CHUNK + 10)
    short.num_new_matched_tokens(again, 0)
    short.plan_stores(again, blocks(again.num_tokens), again.num_tokens, meta)
    assert len(meta.verifies) == 2 and not meta.stores
