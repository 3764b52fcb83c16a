"""A disk read given up on (``load_timeout``, or past the end of a prefix) still runs: its
disk slot is held until it ends, so no chunk written meanwhile can land there and be found
by the late read as "another chunk", then blanked as corrupt."""

import pytest
import torch

from kvtier import KVStore
from kvtier.connector.common.messages import ChunkLoad, ChunkStore, RequestLoad, StepPlan
from kvtier.io.format import HEADER_BYTES
from kvtier.tiers.base import TierName
from tests.helpers.disk_helpers import delayed_io, wait_until
from tests.helpers.fake_io import FakeEngine
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, bookkeeping, make_kv, same_bytes
from tests.helpers.worker_side import LAYERS, same, worker

DISK = TierName.DISK


def seq(start: int) -> list[int]:
    return list(range(start, start + CHUNK))


def get(store: KVStore, tokens: list[int]) -> int:
    out = torch.zeros(SMALL.shape(len(tokens)), dtype=torch.bfloat16)
    n = store.get(tokens, out)
    assert same_bytes(out[:, :, :n], make_kv(tokens)[:, :, :n])
    return n


def test_a_late_read_never_blanks_a_chunk_flushed_into_its_slot_since(tmp_path):
    """Write-back, host 2 slots, disk 4: get(A) gives up on A's held read; put(D) then
    wrote a host victim back into A's freed slot and flush() said it was on disk; A's late
    read found that chunk there, took it for corruption and blanked it: a miss at once, and
    gone after a restart."""
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 2 * CHUNK_BYTES, "disk_paths": [str(tmp_path)],
           "disk_capacity": 4 * (HEADER_BYTES + CHUNK_BYTES), "disk_min_free": 0,
           "write_policy": "write_back", "io_threads": 1, "load_timeout": "300ms",
           "model": "late-read"}
    a, b, c, d = seq(1000), seq(2000), seq(3000), seq(4000)
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, cfg, io_engine=make) as store:
        for tokens in (a, b, c):  # a is written back to disk when c evicts it
            assert store.put(tokens, make_kv(tokens)) == CHUNK
        with bookkeeping(store) as stack:
            a_slot = stack.indexes[DISK].slot_of(store.keys(a)[0])
        reads = engines[0].queues[0]  # reads wait (a slow drive); write-back moves go on
        engines[0].hold(reads)
        try:
            assert get(store, a) == 0  # given up on after load_timeout
            # a host victim is written back (a put waits load_timeout for room: on a busy
            # machine the write-back may take longer, and the put is made again)
            wait_until(lambda: store.put(d, make_kv(d)) == CHUNK, "d stored")
            with bookkeeping(store) as stack:
                assert all(stack.indexes[DISK].slot_of(store.keys(t)[0]) != a_slot for t in (b, c))
        finally:
            engines[0].release(reads)
        assert engines[0].drain(timeout=10)
        assert store.flush(timeout=10)
        for tokens in (b, c, d):
            assert get(store, tokens) == CHUNK
        assert store.stats().corruptions == 0
    with KVStore(SMALL, cfg) as again:
        for tokens in (b, c, d):
            assert get(again, tokens) == CHUNK


@pytest.mark.parametrize("read_ends_first", [False, True], ids=["after", "before"])
def test_a_read_given_up_on_never_blanks_the_next_chunk_written_to_its_slot(tmp_path, monkeypatch,
                                                                          read_ends_first):
    """A read given up on (load_timeout) still runs while the scheduler side, told the load
    failed, frees its disk slot and a write-through puts another chunk there: when the read
    ends it finds that chunk's header, and must leave it alone (it blanks only a slot that
    still names the chunk it read)."""
    side, kv = worker(tmp_path, load_timeout=0.2)
    original = [t.clone() for t in kv]
    k1, k2 = b"1" * 16, b"2" * 16
    side.save(StepPlan(stores=[ChunkStore(k1, (2, 3), host_slot=0, disk_slot=0)]))
    side.drain()
    side.report()
    release = delayed_io(monkeypatch, "preadv")  # the drive stops answering reads
    side.start_loads(StepPlan(loads=[RequestLoad(
        "r1", (ChunkLoad(k1, (10, 11), 0, host_slot=1, disk_slot=0),), asynchronous=True)]))
    wait_until(lambda: "r1" in side.finished(), "the load was not given up")
    assert side.take_invalid_blocks() == {10, 11}
    report = side.report()
    assert report.load_failed["r1"] == {k1} and report.reads_stalled[k1] == 1
    # scheduler side: k1 discarded, disk slot 0 free again; a write-through of k2 takes it
    if read_ends_first:
        release.set()
        side.drain()
        side.finished()
    side.save(StepPlan(stores=[ChunkStore(k2, (4, 5), host_slot=2, disk_slot=0)]))
    wait_until(lambda: side._lane.pending() <= (0 if read_ends_first else 1),
               "the write of k2 never ended")  # only the stalled read left
    assert side.report().disk_written[k2] == 1  # k2 is on disk, and reported so
    release.set()  # the stalled read ends: it finds k2's header
    side.drain()
    side.finished()
    # k2 was written and reported OK: loading it back must work
    side.start_loads(StepPlan(loads=[RequestLoad(
        "r2", (ChunkLoad(k2, (12, 13), 0, host_slot=3, disk_slot=0),), asynchronous=True)]))
    side.drain()
    wait_until(lambda: "r2" in side.finished(), "the load of k2 never ended")
    assert side.take_invalid_blocks() == set()  # k2, written and reported, loads whole
    assert all(same(kv[i][12:14], original[i][4:6]) for i in range(LAYERS))
    side.close()


def test_one_slow_load_counts_once_against_its_path_and_takes_no_path_out(tmp_path, monkeypatch):
    """Three chunks of one load past load_timeout on a busy (not hung) drive: one slow
    answer of the path, not three in a row (which take a path out of service, and every
    chunk cached there with it)."""
    side, _ = worker(tmp_path, load_timeout=0.2)
    keys = [bytes([i + 1]) * 16 for i in range(3)]
    side.save(StepPlan(stores=[ChunkStore(k, (2 * i + 1, 2 * i + 2), i, disk_slot=i)
                               for i, k in enumerate(keys)]))
    side.drain()
    side.report()
    delayed_io(monkeypatch, "preadv", seconds=0.5)  # each read takes 0.5 s
    side.start_loads(StepPlan(loads=[RequestLoad("r", tuple(
        ChunkLoad(k, (10 + i,), 0, host_slot=3 + i, disk_slot=i) for i, k in enumerate(keys)),
        asynchronous=True)]))
    wait_until(lambda: "r" in side.finished(), "the load never ended")
    side.drain()
    side.finished()  # the late reads ended
    report = side.report()
    assert sum(report.reads_stalled.values()) == 3 and not report.paths_down
    side.close()


def test_a_write_into_a_slot_while_a_late_read_checks_it_is_never_blanked(tmp_path, monkeypatch):
    """A late read's clean-up checks that the slot still holds what it read, then blanks it.
    A write of another chunk into the slot (freed meanwhile) that landed between the two
    was blanked, though reported written. Writes and checked blanks of a slot now take
    turns. Found by a review."""
    import os
    import threading

    from kvtier.io.buffers import AlignedBuffer
    from kvtier.io.result import IOStatus
    from tests.helpers.disk_helpers import RAW, chunk, key, make_tier

    tier = make_tier([tmp_path], slots_per_path=2, o_direct=False)
    assert tier.write(0, key(1), chunk(1).array).ok  # K in slot 0
    real, checked, go = os.preadv, threading.Event(), threading.Event()

    def paused_check(fd, bufs, offset, *rest):
        got = real(fd, bufs, offset, *rest)
        if threading.current_thread().name == "late-clean-up":
            checked.set()  # the header read says K: the blank follows
            go.wait(10)
        return got

    monkeypatch.setattr(os, "preadv", paused_check)
    late = threading.Thread(target=tier.invalidate, args=(0, key(1)), name="late-clean-up")
    late.start()
    assert checked.wait(10)
    written = []
    writer = threading.Thread(target=lambda: written.append(tier.write(0, key(2), chunk(2).array)))
    writer.start()  # J into slot 0 (freed by the bookkeeping meanwhile)
    writer.join(0.3)  # it waits for the clean-up, or (before) it lands in its middle
    go.set()
    late.join(10)
    writer.join(10)
    monkeypatch.setattr(os, "preadv", real)
    assert written and written[0].ok
    out = AlignedBuffer(RAW, pin=False)
    assert tier.read(0, key(2), out.array).status is IOStatus.OK
    out.close()
    tier.close()


def test_writes_a_hung_drive_never_ends_take_its_path_out_and_give_host_memory_back(tmp_path):
    """Write-through writes had no deadline: on a drive that stopped answering each kept
    its chunk's host slot pinned, until no store could be planned (host memory frozen). A
    path with a write job out load_timeout without ending now counts against its health as
    a load given up on does, again each further load_timeout; after three the path goes
    out, its queued writes are cancelled and failed, and their host slots come back (the
    chunks stay in host memory). The job running keeps its chunks' slots: it reads them.
    Found by a review."""
    import time

    from kvtier.config.settings import load_config
    from kvtier.connector.scheduler.side import SchedulerSide
    from tests.helpers.worker_side import GEO, worker_and_engine

    side, _, engine = worker_and_engine(tmp_path, load_timeout="50ms", io_threads=1)
    extra = {"chunk_tokens": 32, "host_capacity": 8 * GEO.chunk_bytes, "load_policy": "always",
             "disk_paths": [str(tmp_path)], "disk_capacity": 8 * (4096 + GEO.chunk_bytes),
             "disk_min_free": 0, "load_timeout": "50ms"}
    scheduler = SchedulerSide(load_config(extra, environ={}), GEO,
                              [GEO.namespace("m", "", 1, 0)], 1)

    def step(plan):
        side.start_loads(plan)
        side.save(plan)
        side.finished()
        report = side.report()
        if report is not None:
            scheduler.worker_report(report)

    class Request:
        def __init__(self, name, seed):
            self.request_id, self.num_tokens = name, 64
            self.block_hashes = [bytes([seed, i]) * 16 for i in range(4)]

    engine.hold()  # the drive stops answering
    try:
        for i in range(4):  # 8 chunks: every host slot, each pinned by its write
            plan = scheduler.build_meta()
            scheduler.plan_stores(Request(f"r{i}", i), ([1, 2, 3, 4],), 64, plan)
            step(plan)
        for _ in range(40):  # steps, each past load_timeout: three take the path out
            time.sleep(0.06)
            step(scheduler.build_meta())
            if scheduler.counters["disk_failed_chunks"]:
                break
        assert scheduler.counters["disk_failed_chunks"] == 6  # the 3 queued jobs' chunks
        host = scheduler.stack.indexes[TierName.HOST]
        assert sum(map(host.pinned, host.keys())) == 2  # the running job's
        plan = scheduler.build_meta()
        scheduler.plan_stores(Request("late", 9), ([1, 2, 3, 4],), 64, plan)
        assert len(plan.stores) == 2 and all(s.disk_slot is None for s in plan.stores)
    finally:
        engine.release()
        side.close()
        scheduler.close()


def test_a_demotion_whose_queued_write_was_cancelled_is_failed_once(tmp_path):
    """A load's write-back demotions wait for their writes; a queued one cancelled (its drive
    taken out of service meanwhile) is failed by the cancelling. The wait must end then (a
    plain cancel told no waiter: the job's thread, stuck behind the hung one, would have),
    and the demotion must not fail it again, nor the other writes that report their own
    outcomes: a chunk failed twice by one rank reads, with two ranks, as failed by both."""
    import threading
    import time

    from kvtier.connector.common.messages import DiskWrite
    from kvtier.connector.worker.load_tracker import ReadGate
    from tests.helpers.worker_side import worker_and_engine

    side, _, engine = worker_and_engine(tmp_path, io_threads=1)
    disk = side._disk
    a, b = b"a" * 16, b"b" * 16
    engine.hold()  # the drive stops answering
    try:
        disk.submit_writes([(0, a, 0)])  # holds the path's only thread
        raised: list[BaseException] = []

        load = RequestLoad("r", (), demotions=(DiskWrite(b, host_slot=1, disk_slot=1),))

        def demote() -> None:  # the load's job: its demotions, then its reads (none)
            try:
                disk.demote_then_read(load, ReadGate(), lambda load: {}, side._loader).result(10)
            except BaseException as exc:
                raised.append(exc)
        demoting = threading.Thread(target=demote)
        demoting.start()
        wait_until(lambda: len(disk._writing) == 2, "the demotion's write was never queued")
        for _ in range(50):  # writes out past a timeout, three times: the path goes out
            time.sleep(0.02)
            if disk.note_stalled_writes(0.01):
                break
    finally:
        engine.release()
    demoting.join(10)
    assert not demoting.is_alive(), "the demotion waited on for ever for a write cancelled"
    assert raised == []
    wait_until(lambda: not disk._writing, "the first write never ended")
    report = side.report()
    side.close()
    assert report.paths_down
    assert report.disk_written[a] + report.disk_failed[a] == 1  # its own outcome, once
    assert (report.disk_written[b], report.disk_failed[b]) == (0, 1)  # failed once


def test_loads_whose_write_backs_wait_on_a_hung_drive_hold_up_no_load_on_another_path(tmp_path):
    """write_back: loads whose victims must first be written to a drive that stopped
    answering wait for those writes without holding a thread: a load whose write-back and
    read are on a healthy path loads (both loader threads had waited on the hung drive, and
    it was given up at load_timeout and recomputed, its staging slot held meanwhile: a
    review); the hung ones keep their staging slots until the drive answers."""
    import time

    from kvtier.connector.common.messages import DiskWrite
    from tests.helpers.worker_side import worker_and_engine

    side, _, engine = worker_and_engine(tmp_path, paths=2, load_timeout=0.3,
                                        write_policy="write_back")
    try:
        def key(n: int) -> bytes:
            return bytes([n]) * 16
        side.save(StepPlan(stores=[ChunkStore(key(1), (1, 2), host_slot=3, disk_slot=1)]
                           + [ChunkStore(key(10 + i), (3, 4), host_slot=i) for i in range(3)]))
        side.drain()
        side.finished()
        side.report()
        engine.hold(engine.queues[0])  # path 0 (even disk slots) stops answering
        side.start_loads(StepPlan(loads=[RequestLoad(  # write-backs to path 0
            f"h{i}", (ChunkLoad(key(1), (5, 6), 0, host_slot=i, disk_slot=1),),
            demotions=(DiskWrite(key(10 + i), i, 2 * i),), asynchronous=True) for i in range(2)]))
        side.start_loads(StepPlan(loads=[RequestLoad(  # write-back and read on path 1
            "ok", (ChunkLoad(key(1), (7, 8), 0, host_slot=2, disk_slot=1),),
            demotions=(DiskWrite(key(12), 2, 3),), asynchronous=True)]))
        finished: set[str] = set()
        deadline = time.monotonic() + 10
        while "ok" not in finished and time.monotonic() < deadline:
            finished |= side.finished()
            side.save(StepPlan())  # steps go on
            time.sleep(0.02)
        assert "ok" in finished
        assert side.take_invalid_blocks().isdisjoint({7, 8})  # loaded, not recomputed
    finally:
        engine.release()
        side.close(2)
