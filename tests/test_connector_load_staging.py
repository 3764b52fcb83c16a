"""A load's host staging slots, where a review found them wrong: a chunk whose staging slot a
read given up on still holds, or another load stages, never keeps a request asking again
past ``staging_wait``; a load's staging does not evict its own host chunks; and a step's
stores enter the eviction order so that a prompt's last chunk goes before its first."""

import time
from collections import Counter

import pytest

from kvtier.connector.common.messages import WorkerReport
from kvtier.tiers.base import TierName
from tests.helpers.scheduler_side import CHUNK, request, scheduler, store_all

HOST, DISK = TierName.HOST, TierName.DISK


class StoreHoldsAll:
    """A remote store's answers: it holds every chunk (written through)."""

    def held(self, req_id, keys):
        return [True] * len(keys)

    def failed(self, req_id, keys):
        pass

    def forget(self, req_id):
        pass


def _on_disk_only(side, name="a", chunks=2):
    """A prompt of ``chunks`` chunks stored, then pushed out of host memory to disk."""
    a = request(name, chunks * CHUNK)
    store_all(side, a)
    for other in range(2):
        store_all(side, request(f"push{other}", 2 * CHUNK, seed=50 + other))
    keys = side.chunk_keys(a, chunks)
    assert all(side.stack.locate(k).tier is DISK for k in keys)
    return keys


def _answers_for(side, req, seconds):
    answers, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        answers.append(side.num_new_matched_tokens(req, 0))
        time.sleep(0.02)
    return answers


def test_a_chunk_a_read_given_up_on_still_stages_ends_the_hit_at_once(tmp_path):
    side = scheduler(disk=tmp_path, disk_slots=32, load_timeout="1s")
    keys = _on_disk_only(side)
    hung = request("hung", 2 * CHUNK + 1)
    assert side.num_new_matched_tokens(hung, 0) == (2 * CHUNK, True)
    side.plan_load(hung, (list(range(1, 6)),), 0, 2 * CHUNK)
    side.build_meta()
    late = keys[0]  # its read never ends (a dead mount): the load gave up at load_timeout
    side.worker_report(WorkerReport(load_failed={"hung": {late}}, loads_done=Counter({"hung": 1}),
                                    reads_stalled=Counter({late: 1})))
    side.request_finished("hung")
    side._loads._matcher.presence = StoreHoldsAll()  # the store still holds it
    answers = _answers_for(side, request("b", 2 * CHUNK + 1), 0.3)
    assert (None, False) not in answers, answers  # the hit ends there: never "ask again"


def test_a_chunk_another_load_stages_is_waited_for_only_staging_wait(tmp_path):
    side = scheduler(disk=tmp_path, disk_slots=32, staging_wait="200ms")
    _on_disk_only(side)
    first = request("first", 2 * CHUNK + 1)
    assert side.num_new_matched_tokens(first, 0) == (2 * CHUNK, True)
    side.plan_load(first, (list(range(1, 6)),), 0, 2 * CHUNK)
    side.build_meta()  # its reads stage both chunks: they never report (a hung drive)
    answers = _answers_for(side, request("second", 2 * CHUNK + 1), 0.6)
    assert answers[0] == (None, False)  # another load stages it: ask again, for a while
    assert (0, False) in answers, answers  # then no more: it is recomputed


def _first_chunk_on_disk(tmp_path, write_policy):
    """A prompt of 4 chunks whose first went to disk, the others still in host memory."""
    side = scheduler(disk=tmp_path, disk_slots=32, write_policy=write_policy)  # 4 host slots
    a = request("a", 4 * CHUNK)
    store_all(side, a)
    keys = side.chunk_keys(a, 4)
    for key in keys:  # the first is the least recent, as once the later turns were read
        side.stack.touch(key)
    meta = store_all(side, request("x", CHUNK, seed=9))
    if meta.demotions:  # write-back: c0 written to disk on its way out
        side.worker_report(WorkerReport(disk_written=Counter({d.key: 1 for d in meta.demotions})))
    assert side.stack.locate(keys[0]).tier is DISK
    assert all(side.stack.locate(k).tier is HOST for k in keys[1:])
    return side


def test_a_loads_staging_takes_no_host_slot_of_its_own_chunks(tmp_path):
    for policy in ("write_through", "write_back"):
        side = _first_chunk_on_disk(tmp_path / policy, policy)
        b = request("b", 4 * CHUNK + 1)
        assert side.num_new_matched_tokens(b, 0) == (4 * CHUNK, True)
        side.plan_load(b, (list(range(1, 10)),), 0, 4 * CHUNK)
        (load,) = side.build_meta().loads
        # c0 read from disk into the slot of the other prompt's chunk; c1-c3 from host
        # memory (write-through: they had been read back from disk too; write-back: the
        # load was cut at the chunk being written back)
        assert [c.disk_slot is not None for c in load.chunks] == [True, False, False, False]
        assert all(c.host_slot is not None for c in load.chunks), policy


def test_a_prompts_last_chunk_is_evicted_before_its_first():
    """A key names its whole prefix: with its first chunk gone, a prompt's later chunks stay
    in memory and never hit. A step's stores are committed last chunk first."""
    for seed in range(10):
        side = scheduler()  # 4 host slots, no disk
        a = request("a", 4 * CHUNK, seed=seed)
        store_all(side, a)  # one step: four chunks
        store_all(side, request("x", CHUNK, seed=200 + seed))  # one must go
        gone = [side.stack.locate(k) is None for k in side.chunk_keys(a, 4)]
        assert gone == [False, False, False, True], (seed, gone)


def _hit(side, chunks: int, synchronous: bool, runs: bool = False) -> None:
    """A request hitting its first ``chunks`` chunks, loaded and finished (``runs``: its
    chunks offered for store in the load's step, as build_connector_meta does)."""
    hit = request("hit", chunks * CHUNK + 1)
    assert side.num_new_matched_tokens(hit, 0) == (chunks * CHUNK, not synchronous)
    side.plan_load(hit, (list(range(1, 2 * chunks + 2)),), 0, chunks * CHUNK)
    side.build_meta()
    if runs:
        store_all(side, hit)
    side.worker_report(WorkerReport(loads_done=Counter({"hit": 1})))
    side.request_finished("hit")


@pytest.mark.parametrize("runs", [False, True], ids=["hit", "hit then run"])
def test_after_a_hit_a_prompts_last_chunk_is_evicted_before_its_first(runs):
    """A hit pinned (and so touched) a prompt's chunks head first: its head was then the
    least recent of them and went first, leaving the rest with no hit. The step that loads
    it also offers the request's chunks for store, touching those cached head first. Both
    touch last chunk first now, as a step's stores enter. Found by reviews."""
    side = scheduler()  # 4 host slots, no disk
    a = request("a", 4 * CHUNK)
    store_all(side, a)
    keys = side.chunk_keys(a, 4)
    for key in keys:  # the head the least recent, as after an earlier hit
        side.stack.touch(key)
    _hit(side, 4, synchronous=True, runs=runs)
    store_all(side, request("x", CHUNK, seed=9))  # one must go
    assert [side.stack.locate(k) is None for k in keys] == [False, False, False, True]


def test_a_disk_hit_staged_into_host_memory_keeps_its_head_last(tmp_path):
    """A disk hit's chunks come into host memory as its staging is committed, head first:
    the head was the least recent of them there and went first. The load's chunks are
    touched last chunk first once it is over. Found by a review."""
    side = scheduler(disk=tmp_path, disk_slots=32)  # 4 host slots
    keys = _on_disk_only(side)
    _hit(side, 2, synchronous=False)
    assert all(side.stack.locate(k).tier is HOST for k in keys)
    for seed in range(4):  # single-chunk prompts until one of the hit's leaves host memory
        store_all(side, request(f"x{seed}", CHUNK, seed=100 + seed))
        in_host = [side.stack.locate(k).tier is HOST for k in keys]
        if not all(in_host):
            assert in_host == [True, False], "the head went first"
            return
    raise AssertionError("none of the hit's chunks left host memory")
