"""In vLLM: sampled hits checked against a recompute (``verify_sample``). A request that
would hit is reported as a miss at the sampled rate; as vLLM computes its chunks the
workers compare the fresh pages with the cached copy (from host memory, or read from disk);
a copy that differs (another prompt's pages under this prompt's key: what no checksum
catches) is removed from every tier, its disk header blanked, and past
``verify_halt_after`` no hit is served; a right cache raises no alarm."""

import errno
import time
from collections import Counter

import pytest

from kvtier.connector.common.messages import ChunkLoad, RequestLoad, StepPlan, WorkerReport
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.scheduler.verify_planner import MAX_IN_FLIGHT
from kvtier.io.buffers import AlignedBuffer
from kvtier.tiers.base import TierName
from tests.helpers.scheduler_side import GEO as GEO_S
from tests.helpers.scheduler_side import request, scheduler, store_all
from tests.helpers.shared import wait_for
from tests.helpers.worker_side import GEO, same, worker, worker_and_engine

HOST, DISK = TierName.HOST, TierName.DISK
BLOCKS = ([1, 2, 3, 4, 5],)  # a 65-token request's blocks
OTHER = [9, 10]  # another prompt's pages


def store(side: SchedulerSide, w, name: str) -> list:
    """Store a 64-token prompt through both sides, as vLLM's steps would."""
    meta = side.build_meta()
    side.plan_stores(request(name, 64), (BLOCKS[0][:4],), 64, meta)
    w.save(meta)
    assert w.drain(5)
    side.worker_report(w.report())
    return [s.key for s in meta.stores]


def check(side: SchedulerSide, w, name: str, count: int) -> StepPlan:
    """A request for the same prompt: sampled (a miss to vLLM), then computed and checked."""
    req = request(name, 65)
    assert side.num_new_matched_tokens(req, 0) == (0, False)
    meta = side.build_meta()
    side.plan_stores(req, BLOCKS, 64, meta)
    assert len(meta.verifies) == count
    w.save(meta)
    got, deadline = WorkerReport(), time.monotonic() + 10
    while sum((got.verified + got.verify_differed + got.verify_failed).values()) < count:
        assert time.monotonic() < deadline, got
        got = got.merged(w.report() or WorkerReport())
        time.sleep(0.01)
    side.worker_report(got)
    return meta


def wrong_pages_into(w, slot: int) -> None:
    """Another prompt's pages into host slot ``slot``: a valid chunk under the wrong key."""
    w.pages.gather(OTHER, w.host.slot(slot))


@pytest.fixture
def sides(tmp_path):
    made = []

    def make(**extra):
        side = scheduler(disk=tmp_path, instance_id="a", verify_sample=1, **extra)
        w, _ = worker(tmp_path, instance_id="a", verify_sample=1)
        made.append((side, w))
        return side, w

    yield make
    for side, w in made:
        side.close()
        w.close(5)


def test_a_right_cache_is_checked_and_kept(sides):
    side, w = sides()
    keys = store(side, w, "x")
    meta = check(side, w, "y", 2)
    assert {v.tier for v in meta.verifies} == {"host"}
    assert side.counters["chunks_verified"] == 2 and side.counters["verify_sampled_requests"] == 1
    assert not any(side.counters[f"verify_mismatches_{t}"] for t in ("host", "disk"))
    host = side.stack.indexes[HOST]
    assert all(side.stack.locate(k) is not None and not host.pinned(k) for k in keys)


def test_another_prompts_pages_in_host_memory_are_caught_and_removed_everywhere(sides, tmp_path):
    side, w = sides()
    keys = store(side, w, "x")
    wrong_pages_into(w, side.stack.locate(keys[1]).slot)
    check(side, w, "y", 2)
    assert side.counters["verify_mismatches_host"] == 1 and side.counters["chunks_verified"] == 2
    assert side.stack.locate(keys[0]) is not None
    assert side.stack.locate(keys[1]) is None and keys[1] not in side.stack.indexes[DISK]
    w.close(5)
    again = scheduler(disk=tmp_path, instance_id="a")  # its disk copy was blanked too
    assert again.recovered == 1 and again.stack.locate(keys[1]) is None
    again.close()


def test_a_chunk_found_wrong_has_its_older_copies_on_disk_blanked_too(sides, tmp_path):
    """A second copy of the chunk in a slot the bookkeeping no longer knows (given back
    unwritten after a failed read, say) came back at the next start. Found by a review."""
    side, w = sides()
    keys = store(side, w, "x")
    slot = side.stack.locate(keys[1]).slot
    wrong_pages_into(w, slot)
    buffer = AlignedBuffer(GEO.chunk_bytes)
    buffer.array[:] = w.host.slot_array(slot)[:GEO.chunk_bytes]
    spare = side.stack.indexes[DISK].num_slots - 1  # never handed out
    assert w.disk.write(spare, keys[1], buffer.array).ok
    check(side, w, "y", 2)
    assert side.counters["verify_mismatches_host"] == 1
    w.close(5)
    again = scheduler(disk=tmp_path, instance_id="a")
    assert again.recovered == 1 and again.stack.locate(keys[1]) is None
    again.close()


def test_a_copy_read_from_disk_is_checked_there(sides, tmp_path):
    side, w = sides()
    keys = store(side, w, "x")
    buffer = AlignedBuffer(GEO.chunk_bytes)
    wrong_pages_into(w, 7)
    buffer.array[:] = w.host.slot_array(7)[:GEO.chunk_bytes]
    slot = side.stack.indexes[DISK].pin(keys[0])
    side.stack.indexes[DISK].unpin(keys[0])
    assert w.disk.write(slot, keys[0], buffer.array).ok  # its key, a valid checksum
    side.close()
    restarted, _ = scheduler(disk=tmp_path, instance_id="a", verify_sample=1), None
    assert restarted.recovered == 2
    meta = check(restarted, w, "y", 2)
    assert {v.tier for v in meta.verifies} == {"disk"}
    assert all(v.source.disk_slot is not None and v.source.staged for v in meta.verifies)
    assert restarted.counters["verify_mismatches_disk"] == 1
    assert restarted.stack.locate(keys[0]) is None
    assert restarted.stack.locate(keys[1]).tier is HOST  # read, right: kept in host memory
    restarted.close()


def test_past_verify_halt_after_no_hit_is_served_even_after_a_restart(sides, tmp_path):
    side, w = sides(verify_halt_after=1)
    keys = store(side, w, "x")
    wrong_pages_into(w, side.stack.locate(keys[0]).slot)
    check(side, w, "y", 2)
    assert side.halt.halted and side.counters["verify_halted"] == 1
    assert side.stack.locate(keys[1]) is not None
    side.verify.rate = 0.0  # not sampled: refused all the same
    assert side.num_new_matched_tokens(request("z", 65), 0) == (0, False)
    wait_for(lambda: any(tmp_path.glob("*/halt.json")))  # written off the scheduler's thread
    (halt,) = tmp_path.glob("*/halt.json")
    side.close()
    restarted = scheduler(disk=tmp_path, instance_id="a", verify_sample=0)
    store_all(restarted, request("other", 64, seed=5))
    assert restarted.halt.halted
    assert restarted.num_new_matched_tokens(request("z", 65, seed=5), 0) == (0, False)
    halt.unlink()  # as kvtier verify --repair does
    restarted.halt.look()
    assert restarted.num_new_matched_tokens(request("z2", 65, seed=5), 0) == (64, False)
    restarted.close()


def test_a_chunk_still_being_written_to_disk_is_checked_at_a_later_sample(tmp_path):
    """Removed while its write-through runs, it would land on disk after: not checked yet."""
    side = scheduler(disk=tmp_path, verify_sample=1)
    meta = StepPlan()
    side.plan_stores(request("x", 64), ([1, 2, 3, 4],), 64, meta)
    side.worker_report(WorkerReport(host_stored=Counter({s.key: 1 for s in meta.stores})))
    assert side.num_new_matched_tokens(request("y", 65), 0) == (0, False)
    early = StepPlan()
    side.plan_stores(request("y", 65), BLOCKS, 64, early)
    assert not early.verifies and not early.stores
    side.worker_report(WorkerReport(disk_written=Counter({s.key: 1 for s in meta.stores})))
    assert side.num_new_matched_tokens(request("z", 65), 0) == (0, False)
    later = StepPlan()
    side.plan_stores(request("z", 65), BLOCKS, 64, later)
    assert len(later.verifies) == 2
    side.close()


def test_the_sample_is_every_nth_hit_and_only_hits():
    side = scheduler(verify_sample="1/4")
    meta = StepPlan()
    side.plan_stores(request("x", 64), ([1, 2, 3, 4],), 64, meta)
    side.worker_report(WorkerReport(host_stored=Counter({s.key: 1 for s in meta.stores})))
    assert side.num_new_matched_tokens(request("miss", 65, seed=9), 0) == (0, False)
    got = [side.num_new_matched_tokens(request(f"r{i}", 65), 0)[0] for i in range(8)]
    assert got == [64, 64, 64, 0, 64, 64, 64, 0]
    again = side.num_new_matched_tokens(request("r3", 65), 0)  # asked again: still sampled
    assert again == (0, False) and side.counters["verify_sampled_requests"] == 2
    off = scheduler(verify_sample=0)
    assert off.verify.sample(off.track(request("q", 65))) is False
    side.close()
    off.close()


def restarted_with_engine(tmp_path, **config):
    """Chunks of a 64-token prompt on disk, then a restarted scheduler that finds them
    there (host memory empty) and a worker whose disk reads a test can fail or hold."""
    first = scheduler(disk=tmp_path, instance_id="a")
    w, _, engine = worker_and_engine(tmp_path, instance_id="a", **config)
    keys = store(first, w, "x")
    first.close()
    side = scheduler(disk=tmp_path, instance_id="a", verify_sample=1)
    assert side.recovered == 2
    return side, w, engine, keys


def test_a_copy_that_cannot_be_read_is_neither_right_nor_wrong_and_is_dropped(tmp_path):
    """As a failed load's copy is: it is not served again."""
    side, w, engine, keys = restarted_with_engine(tmp_path)
    try:
        engine.fail(OSError(errno.EIO, "injected"))
        check(side, w, "y", 2)
        assert side.counters["verify_unread_chunks"] == 2 and side.counters["chunks_verified"] == 0
        assert not side.counters["verify_mismatches_disk"]
        host = side.stack.indexes[HOST]
        assert all(side.stack.locate(k) is None and not host.has_entry(k) for k in keys)
    finally:
        side.close()
        w.close(5)


def checked_in_an_unfilled_step(side: SchedulerSide, w, name: str, count: int) -> None:
    """``check``'s request, in a step where a load left blocks unfilled (a sync load whose
    chunk lost its host slot since the match): what the step computed may have attended
    them, so its checks are not made (``verify_skipped``)."""
    req = request(name, 65)
    assert side.num_new_matched_tokens(req, 0) == (0, False)
    meta = side.build_meta()
    side.plan_stores(req, BLOCKS, 64, meta)
    assert len(meta.verifies) == count
    w.start_loads(StepPlan(loads=[RequestLoad("r", (ChunkLoad(b"X" * 16, (7, 8), 0, None),))]))
    w.save(meta)
    w.finished()
    report = w.report()
    assert w.take_invalid_blocks() == {7, 8} and sum(report.verify_skipped.values()) == count
    assert not (report.verified or report.verify_differed or report.verify_failed)
    side.worker_report(report)


def test_checks_in_a_step_whose_kv_may_be_wrong_are_not_made_and_keep_their_copies(sides):
    """A copy compared with pages that may have attended unfilled blocks would be found
    wrong, removed everywhere, and counted towards ``verify_halt_after`` (a review): the
    check is not made, nothing is counted, the copy stays."""
    side, w = sides()
    keys = store(side, w, "x")
    wrong_pages_into(w, side.stack.locate(keys[1]).slot)  # a check made would find it
    checked_in_an_unfilled_step(side, w, "y", 2)
    assert not any(side.counters[name] for name in (
        "verify_mismatches_host", "chunks_verified", "verify_unread_chunks"))
    host = side.stack.indexes[HOST]
    assert all(side.stack.locate(k).tier is HOST and not host.pinned(k) for k in keys)


def test_with_tensor_parallelism_a_check_one_rank_did_not_make_has_no_verdict(tmp_path):
    """A load left blocks unfilled on one rank only (one that raised there): the other
    ranks' KV came through that rank's in the all-reduce, so their check that differed
    says nothing of the copy either; it is kept and nothing counted (a review)."""
    side = scheduler(world=2, verify_sample=1)
    try:
        store_all(side, request("x", 64), world=2)
        req = request("y", 65)
        assert side.num_new_matched_tokens(req, 0) == (0, False)
        meta = side.build_meta()
        side.plan_stores(req, BLOCKS, 64, meta)
        keys = [v.source.key for v in meta.verifies]
        assert len(keys) == 2
        side.worker_report(WorkerReport(verify_skipped=Counter(keys)).merged(
            WorkerReport(verify_differed=Counter(keys))))
        assert not any(side.counters[name] for name in (
            "verify_mismatches_host", "chunks_verified", "verify_unread_chunks"))
        assert all(side.stack.locate(k) is not None for k in keys)
    finally:
        side.close()


def test_a_check_not_made_of_a_copy_on_disk_leaves_it_there_and_its_staging_slot_empty(tmp_path):
    """The staging slot a check not made reserved was never read into: it is given back,
    not kept as a copy of the chunk."""
    side, w, _, keys = restarted_with_engine(tmp_path)
    try:
        checked_in_an_unfilled_step(side, w, "y", 2)
        host = side.stack.indexes[HOST]
        assert all(side.stack.locate(k).tier is DISK and not host.has_entry(k) for k in keys)
        assert host.free_slots == host.num_slots
    finally:
        side.close()
        w.close(5)


def test_a_read_past_load_timeout_holds_its_staging_slot_and_holds_up_no_request(tmp_path):
    """The copy a hung read was given up on is dropped: left visible beside the staging
    slot the read still holds, it would look as if another load were staging it, and
    every request with that prefix would be asked about again until the read ended."""
    side, w, engine, keys = restarted_with_engine(tmp_path, load_timeout="200ms")
    try:
        engine.hold()
        check(side, w, "y", 2)  # given up on after load_timeout: unread
        host = side.stack.indexes[HOST]
        assert side.counters["verify_unread_chunks"] == 2
        assert all(host.has_entry(k) for k in keys)  # a read may still fill the slots
        assert all(side.stack.locate(k) is None for k in keys)
        assert side.num_new_matched_tokens(request("q", 65), 0) == (0, False)  # not "ask again"
        engine.release()
        deadline = time.monotonic() + 10
        while any(host.has_entry(k) for k in keys):
            assert time.monotonic() < deadline
            side.worker_report(w.report() or WorkerReport())
            time.sleep(0.01)
    finally:
        engine.release()  # a failed assertion must not leave the read hung
        side.close()
        w.close(5)


def test_chunks_vllms_own_prefix_cache_held_are_not_checked():
    """vLLM did not compute them for the sampled request: its GPU blocks may hold kvtier's
    own bytes, loaded by an earlier request (vLLM caches loaded blocks), and would be
    compared with the very copy they came from."""
    side = scheduler()
    try:
        store_all(side, request("x", 128))  # chunks 0-3 in host memory
        side.verify.rate = 1.0
        b = request("b", 129)
        assert side.num_new_matched_tokens(b, 64) == (0, False)  # vLLM holds chunks 0-1
        meta = StepPlan()
        side.plan_stores(b, (list(range(1, 10)),), 129, meta)
        assert [v.source.key for v in meta.verifies] == side.chunk_keys(b, 4)[2:]
    finally:
        side.close()


def test_a_request_asked_about_again_and_again_is_sampled_once_at_most():
    """vLLM asks again each step while a request cannot be admitted: the sampling share is
    of requests that would hit, not of asks."""
    side = scheduler(verify_sample=0.01)
    try:
        store_all(side, request("x", 64))
        r = request("r", 65)
        assert {side.num_new_matched_tokens(r, 0) for _ in range(300)} == {(64, False)}
        assert side.counters["verify_sampled_requests"] == 0
    finally:
        side.close()


def test_a_sampled_request_whose_prefix_vllm_loaded_meanwhile_checks_none_of_it():
    """Sampled at its first ask (a miss), the request waits; another request loads the
    prefix from kvtier into vLLM's prefix cache, so vLLM asks again with it computed and
    nothing left to load: those blocks hold the cached copy itself, never checked."""
    side = scheduler(verify_sample=1)
    try:
        store_all(side, request("x", 64))  # chunks 0-1 in host memory
        y = request("y", 65)
        assert side.num_new_matched_tokens(y, 0) == (0, False)  # sampled
        assert side.num_new_matched_tokens(y, 64) == (0, False)  # vLLM holds 0-1 now
        meta = StepPlan()
        side.plan_stores(y, ([1, 2, 3, 4, 5],), 65, meta)
        assert meta.verifies == []
        assert side.counters["verify_sampled_requests"] == 1
    finally:
        side.close()


def test_one_sampled_long_prompt_checks_at_most_max_in_flight_chunks_at_once():
    """``MAX_IN_FLIGHT`` bounds the chunks being checked, not only the requests sampled: a
    long prompt's chunks past it are only touched, and hold no host slot."""
    side = scheduler(verify_sample=1, host_capacity=64 * GEO_S.chunk_bytes)
    try:
        store_all(side, request("x", 40 * 32))
        y = request("y", 40 * 32 + 1)
        assert side.num_new_matched_tokens(y, 0) == (0, False)
        meta = StepPlan()
        side.plan_stores(y, (list(range(1, 82)),), 40 * 32 + 1, meta)
        assert len(meta.verifies) == MAX_IN_FLIGHT
        assert side.stack.indexes[HOST].census().pins == MAX_IN_FLIGHT
    finally:
        side.close()


def test_checked_copies_on_disk_stage_in_at_most_a_share_of_the_host_slots(tmp_path):
    side = scheduler(disk=tmp_path, disk_slots=64, verify_sample=1,
                     host_capacity=8 * GEO_S.chunk_bytes)
    try:
        x = request("x", 40 * 32)
        for n in range(1, 41):  # one chunk a step, each written through to disk
            store_all_upto(side, x, n * 32)
        assert len(side.stack.indexes[DISK]) == 40
        y = request("y", 40 * 32 + 1)
        assert side.num_new_matched_tokens(y, 0) == (0, False)
        meta = StepPlan()
        side.plan_stores(y, (list(range(1, 82)),), 40 * 32 + 1, meta)
        staged = [v for v in meta.verifies if v.source.staged]
        assert 0 < len(staged) <= 4  # half of 8 host slots
    finally:
        side.close()


def store_all_upto(side: SchedulerSide, req, tokens: int) -> None:
    meta = StepPlan()
    side.plan_stores(req, (list(range(100, 100 + req.num_tokens // 16)),), tokens, meta)
    done = Counter({s.key: 1 for s in meta.stores})
    side.worker_report(WorkerReport(host_stored=done, disk_written=Counter(
        {s.key: 1 for s in meta.stores if s.disk_slot is not None})))


def test_bytes_of_a_format_kvtier_cannot_decode_that_differ_halt_nothing():
    """An fp8 or integer cache kvtier cannot decode: a recompute in another batch shape may
    flip bytes of a right chunk, so such a check is counted apart, its copy kept, and it
    never counts toward ``verify_halt_after``."""
    side = scheduler(verify_sample=1, verify_halt_after=1)
    try:
        store_all(side, request("x", 64))
        y = request("y", 65)
        assert side.num_new_matched_tokens(y, 0) == (0, False)
        meta = StepPlan()
        side.plan_stores(y, BLOCKS, 64, meta)
        keys = [v.source.key for v in meta.verifies]
        assert len(keys) == 2
        side.worker_report(WorkerReport(verify_undecided=Counter(keys)))
        assert not side.halt.halted and side.counters["verify_undecided_chunks"] == 2
        assert all(side.stack.locate(k) is not None for k in keys)
        side.verify.rate = 0.0
        assert side.num_new_matched_tokens(request("z", 65), 0) == (64, False)  # hits served
    finally:
        side.close()


def test_a_sampled_copy_the_store_lost_is_told_as_lost_and_one_timed_out_is_not(tmp_path):
    """A check's read of the remote store answered missing or damaged: the store lost it,
    for certain, told as a load's read tells it (``remote_absent``: written again, removed
    from the KV events); a read that failed otherwise (timed out) is no loss."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from kvtier.connector.scheduler.verify_planner import REMOTE
    from kvtier.connector.worker.verify import WorkerVerify
    from kvtier.io.result import IOResult, IOStatus
    from kvtier.keys import ChunkKey

    w, _ = worker(tmp_path, verify_sample=1)
    verify = w._verify or WorkerVerify.of(w.config, w.geometry, w.pages, w.host, w._ledger,
                                          w._lane)
    for i, (status, told) in enumerate(((IOStatus.TIMED_OUT, False), (IOStatus.IO_ERROR, False),
                                        (IOStatus.MISSING, True), (IOStatus.CORRUPT, True))):
        key = bytes([i]) * 16
        read: Future = Future()
        read.set_result(IOResult(status))
        check = SimpleNamespace(source=SimpleNamespace(key=key, remote=True, other=None))
        assert not verify._read_ok(check, read)
        assert (key in w._ledger.pending.remote_absent) is told, status
    side = scheduler()
    lost = []
    side.verify.remote_writes = SimpleNamespace(lost=lost.append)
    side.verify._unread(ChunkKey(b"k" * 16), SimpleNamespace(tier=REMOTE, req_id="r", refs=None))
    assert lost == []  # no certain loss: the workers say when there is one
    w.close()


def test_a_check_failed_on_a_slot_still_written_back_keeps_it_until_the_write_is_over(tmp_path):
    """Write-back, a slow drive: a sampled check's staging slot is one whose victim's
    write-back (a demotion) is not over by ``load_timeout``, so the worker fails the check.
    The slot stays reserved until that write is over: a store planned meanwhile goes
    elsewhere, and the victim's disk copy holds the victim's bytes, not the next chunk's
    (before, the slot was given back at once, and the write read another prompt's pages)."""
    cfg = {"instance_id": "a", "write_policy": "write_back", "load_timeout": "100ms",
           "verify_sample": 1}
    side = scheduler(disk=tmp_path, **cfg)
    w, kv, engine = worker_and_engine(tmp_path, **cfg)
    original = [t.clone() for t in kv]

    def settle(seconds: float = 0.3) -> None:
        got, end = WorkerReport(), time.monotonic() + seconds
        while time.monotonic() < end:
            w.finished()
            got = got.merged(w.report() or WorkerReport())
            time.sleep(0.02)
        side.worker_report(got)

    def put(name: str, blocks: list[int], seed: int, held: bool = False) -> StepPlan:
        meta = side.build_meta()
        side.plan_stores(request(name, 64, seed=seed), (blocks,), 64, meta)
        w.save(meta)
        assert w.drain(0.5 if held else 5) is not held  # (held: the drive hung)
        settle()
        return meta

    try:
        put("x", [1, 2, 3, 4], 1)
        put("y", [5, 6, 7, 8], 2)
        put("z", [9, 10, 11, 12], 3)  # x's chunks written back to disk
        x = side.chunk_keys(request("x", 64, seed=1), 2)
        assert [side.stack.locate(k).tier for k in x] == [DISK, DISK]
        sampled = request("x2", 65, seed=1)
        assert side.num_new_matched_tokens(sampled, 0) == (0, False)
        meta = side.build_meta()
        side.plan_stores(sampled, ([1, 2, 3, 4, 13],), 64, meta)
        assert len(meta.verifies) == 2 and len(meta.demotions) == 2
        victims = {d.host_slot: d.key for d in meta.demotions}
        engine.hold()  # their write-backs outlast load_timeout
        w.save(meta)
        settle(0.5)
        assert side.counters["verify_unread_chunks"] == 2
        host = side.stack.indexes[HOST]
        assert all(host.has_entry(k) for k in x)  # the staging slots still reserved
        later = put("n", [13, 14, 15, 12], 4, held=True)
        assert not {s.host_slot for s in later.stores} & set(victims)
        engine.release()
        assert w.drain(5)
        settle()
        assert not any(host.has_entry(k) for k in x)  # ended once the writes were over
        y = side.chunk_keys(request("y", 64, seed=2), 2)
        assert set(victims.values()) == set(y) and all(side.stack.locate(k).tier is DISK for k in y)
        again = request("y-again", 65, seed=2)
        side.verify.rate = 0
        w._loads.timeout = 30.0  # the drive no longer held: a loaded machine's read is no fault
        loaded, _ = side.num_new_matched_tokens(again, 0)
        for t in kv:
            t[[1, 2, 3, 4]] = 0
        side.plan_load(again, ([1, 2, 3, 4, 14],), 0, loaded)
        w.start_loads(side.build_meta())
        wait_for(lambda: again.request_id in w.finished())
        assert not w.take_invalid_blocks()
        for dst, src in zip([1, 2, 3, 4], [5, 6, 7, 8], strict=True):
            assert all(same(kv[layer][dst], original[layer][src]) for layer in range(len(kv)))
    finally:
        engine.release()
        side.close()
        w.close(5)


def test_closing_waits_for_the_check_running_not_for_those_it_cancelled(tmp_path):
    """Closing cancels the checks still queued (a pool's plain cancel tells no ``wait``er:
    only the thread that would run them does) and waits for the one running: it ends as
    soon as that one does, instead of always waiting its whole timeout and saying no."""
    import threading

    w, _ = worker(tmp_path, verify_sample=1)
    verify = w._verify
    assert verify is not None
    started, release = threading.Event(), threading.Event()
    running = verify._pool.submit(lambda: (started.set(), release.wait(20)))
    queued = verify._pool.submit(lambda: None)  # behind it: the pool has one thread
    verify._jobs = [running, queued]
    assert started.wait(10)
    threading.Timer(0.2, release.set).start()
    assert verify.close(timeout=20) is True
    assert queued.cancelled() and running.done() and not running.cancelled()
    w.close()
