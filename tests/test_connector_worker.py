"""The connector's worker side with a synthetic paged cache: copies, disk I/O, failures."""

import dataclasses
import errno
import time
from collections import Counter

import pytest
import torch

from kvtier.connector.common.messages import ChunkLoad, ChunkStore, RequestLoad, StepPlan
from kvtier.connector.worker.side import WorkerSide
from tests.helpers.disk_helpers import failing_io, wait_until
from tests.helpers.worker_side import BLOCKS, GEO, LAYERS, same, worker, worker_and_engine


def outcomes(side: WorkerSide, into: dict) -> dict:
    """Step the worker once and add its report's counts to ``into``."""
    side.finished()
    report = side.report()
    for name in ("reads_over", "disk_written") if report else ():
        into.setdefault(name, Counter()).update(getattr(report, name))
    return into


def test_store_to_host_and_disk_then_load_back(tmp_path):
    side, kv = worker(tmp_path)
    original = [t.clone() for t in kv]
    side.save(StepPlan(stores=[ChunkStore(b"k" * 16, (3, 4), host_slot=0, disk_slot=5)]))
    side.drain()
    report = side.report()
    assert report.host_stored[b"k" * 16] == 1 and report.disk_written[b"k" * 16] == 1
    for t in kv:
        t[8:10].zero_()
    load = RequestLoad("r", (ChunkLoad(b"k" * 16, (8, 9), 0, host_slot=1, disk_slot=5),),
                       asynchronous=True)
    side.start_loads(StepPlan(loads=[load]))
    side.drain()
    assert side.finished() == {"r"} and side.take_invalid_blocks() == set()
    assert all(same(kv[i][8:10], original[i][3:5]) for i in range(LAYERS))
    assert side.report().loads_done["r"] == 1
    side.close()


def test_a_tail_store_zeroes_the_rest_of_its_slot_and_loads_back_its_blocks(tmp_path):
    """(a prompt's tail: fewer blocks than a chunk's; the slot's previous chunk must not
    go to disk with it)"""
    side, kv = worker(tmp_path)
    original = [t.clone() for t in kv]
    side.save(StepPlan(stores=[ChunkStore(b"f" * 16, (5, 6), host_slot=0)]))  # a full chunk
    side.save(StepPlan(stores=[ChunkStore(b"t" * 16, (3,), host_slot=0, disk_slot=2)]))
    side.drain()
    assert side.report().disk_written[b"t" * 16] == 1
    slot = side._attached()[1].slot(0)[: GEO.chunk_bytes].view(LAYERS, 2, GEO.page_bytes)
    assert not slot[:, 1].any() and slot[:, 0].any()
    for t in kv:
        t[9].zero_()
    load = RequestLoad("r", (ChunkLoad(b"t" * 16, (9,), 0, host_slot=1, disk_slot=2),),
                       asynchronous=True)
    side.start_loads(StepPlan(loads=[load]))
    side.drain()
    assert side.finished() == {"r"} and side.take_invalid_blocks() == set()
    assert all(same(kv[i][9], original[i][3]) for i in range(LAYERS))
    side.close()


def test_a_host_load_is_done_before_the_forward(tmp_path):
    side, kv = worker(tmp_path, disk=False)
    original = [t.clone() for t in kv]
    side.save(StepPlan(stores=[ChunkStore(b"h" * 16, (1, 2), host_slot=2)]))
    side.start_loads(StepPlan(loads=[RequestLoad("r", (ChunkLoad(b"h" * 16, (7,), 1, 2),))]))
    assert all(same(kv[i][7], original[i][2]) for i in range(LAYERS))
    assert side.finished() == set()  # synchronous: not reported to vLLM as an async load
    assert side.report().loads_done["r"] == 1
    side.close()


def test_a_failed_disk_read_reports_the_blocks_for_recompute(tmp_path, monkeypatch):
    side, _ = worker(tmp_path)
    side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (14, 15), 0, disk_slot=0),
                                     ChunkStore(b"b" * 16, (2, 3), 1, disk_slot=1)]))
    side.drain()
    side.report()
    chunks = (ChunkLoad(b"a" * 16, (10, 11), 0, 2, disk_slot=0),
              ChunkLoad(b"b" * 16, (12, 13), 0, 3, disk_slot=1))
    with failing_io(monkeypatch, "slots-", err=errno.EIO, calls=("preadv",)):
        side.start_loads(StepPlan(loads=[RequestLoad("r", chunks, asynchronous=True)]))
        side.drain()
        assert side.finished() == {"r"}
    assert side.take_invalid_blocks() == {10, 11, 12, 13}
    assert side.report().load_failed["r"] == {b"a" * 16, b"b" * 16}
    side.close()


def test_a_copy_that_fails_is_a_failed_store_not_a_crash(tmp_path):
    side, _ = worker(tmp_path, disk=False)
    side.save(StepPlan(stores=[ChunkStore(b"x" * 16, (BLOCKS + 5, 0), host_slot=0)]))
    assert side.report().host_failed[b"x" * 16] == 1
    side.close()


def test_a_copy_that_fails_reports_its_write_through_failed_too(tmp_path):
    """(so that the scheduler side hears every rank's disk outcome of it, and keeps its
    slots until the other ranks' writes of it are over)"""
    side, _ = worker(tmp_path)
    side.save(StepPlan(stores=[ChunkStore(b"x" * 16, (BLOCKS + 5, 0), host_slot=0, disk_slot=0)]))
    side.drain(10)
    report = side.report()
    assert report.host_failed[b"x" * 16] == 1 and report.disk_failed[b"x" * 16] == 1
    assert not report.disk_written
    side.close()


def test_a_load_without_a_host_slot_fails_cleanly(tmp_path):
    side, _ = worker(tmp_path)
    load = RequestLoad("r", (ChunkLoad(b"z" * 16, (5, 6), 0, host_slot=None, disk_slot=3),),
                       asynchronous=True)
    side.start_loads(StepPlan(loads=[load]))
    assert side.finished() == {"r"} and side.take_invalid_blocks() == {5, 6}
    side.close()


@pytest.mark.parametrize("reference_cpu_mla, invalid", [(False, {9, 10}), (True, {7, 8, 9, 10})])
def test_a_chunk_not_loaded_invalidates_the_rest_or_on_the_reference_mla_backend_all(
        tmp_path, reference_cpu_mla, invalid):
    """vLLM recomputes from the first invalid block. Its reference MLA backend on the CPU
    cannot go on from part of a hit: there a load whose second chunk is not loaded reports
    every block invalid, and its first chunk, which loaded, is not reported failed."""
    side, _ = worker(tmp_path, disk=False)
    side.geometry = dataclasses.replace(side.geometry, reference_cpu_mla=reference_cpu_mla)
    side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (1, 2), host_slot=0)]))
    load = RequestLoad("r", (ChunkLoad(b"a" * 16, (7, 8), 0, 0),
                             ChunkLoad(b"b" * 16, (9, 10), 0, host_slot=None)))
    side.start_loads(StepPlan(loads=[load]))
    side.finished()  # (a step's end: what vLLM asks for then)
    assert side.take_invalid_blocks() == invalid
    assert b"a" * 16 not in side.report().load_failed.get("r", set())
    side.close()


def test_a_disk_path_out_of_service_is_reported_then_reported_back(tmp_path, monkeypatch):
    from collections import Counter

    side, _ = worker(tmp_path, disk_retry=0.001)
    with failing_io(monkeypatch, "slots-", err=errno.EROFS, calls=("pwritev",)):
        side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (14, 15), 0, disk_slot=0)]))
        side.drain()
    report = side.report()
    assert report.paths_down == Counter({0: 1}) and report.disk_failed[b"a" * 16] == 1
    time.sleep(0.01)  # past disk_retry
    side.save(StepPlan())  # each step tries a path that is due
    side.drain()
    report = side.report()
    assert report.paths_up == Counter({0: 1}) and not report.paths_down
    side.save(StepPlan(stores=[ChunkStore(b"b" * 16, (2, 3), 1, disk_slot=0)]))
    side.drain()
    assert side.report().disk_written[b"b" * 16] == 1
    side.close()


def test_a_load_whose_write_back_fails_reports_the_write_failed_and_loads_on(tmp_path, monkeypatch):
    """The victim's write failed: it is lost to the disk (reported once, so its disk
    reservation is given back), and the load into its staging slot goes on."""
    from kvtier.connector.common.messages import DiskWrite

    side, _ = worker(tmp_path)
    side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (2, 3), 1, disk_slot=0)]))
    side.drain()
    side.report()

    def broken(items, records=None):
        raise RuntimeError("write path broken")

    monkeypatch.setattr(side.disk, "write_many", broken)
    load = RequestLoad("r", (ChunkLoad(b"a" * 16, (10, 11), 0, host_slot=0, disk_slot=0),),
                       demotions=(DiskWrite(b"v" * 16, host_slot=0, disk_slot=3),),
                       asynchronous=True)
    side.start_loads(StepPlan(loads=[load]))
    wait_until(lambda: side.finished() == {"r"}, "the load was never reported finished")
    report = side.report()
    assert report.disk_failed[b"v" * 16] == 1 and not report.disk_written[b"v" * 16]
    assert side.take_invalid_blocks() == set()
    side.close()


def test_a_hung_disk_read_is_given_up_and_its_slot_held_until_it_ends(tmp_path):
    side, _, engine = worker_and_engine(tmp_path, load_timeout=0.2)
    side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (2, 3), 1, disk_slot=0)]))
    side.drain()
    side.report()
    engine.hold()  # a drive that does not answer
    load = RequestLoad("r", (ChunkLoad(b"a" * 16, (10, 11), 0, host_slot=0, disk_slot=0),),
                       asynchronous=True)
    side.start_loads(StepPlan(loads=[load]))
    assert side.finished() == set()  # not yet: within load_timeout
    wait_until(lambda: side.finished() == {"r"}, "a hung read held the request")
    assert side.take_invalid_blocks() == {10, 11}
    report = side.report()
    assert report.load_failed["r"] == {b"a" * 16} and report.reads_stalled[b"a" * 16] == 1
    assert not report.reads_over
    engine.release()
    side.drain()
    side.finished()
    assert side.report().reads_over[b"a" * 16] == 1  # now the staging slot may be reused
    side.close()


def test_reads_that_keep_getting_no_answer_take_the_path_out(tmp_path):
    side, _, engine = worker_and_engine(tmp_path, load_timeout=0.1)
    keys = [bytes([i]) * 16 for i in range(3)]
    side.save(StepPlan(stores=[ChunkStore(k, (2 * i + 1, 2 * i + 2), i, disk_slot=i)
                                     for i, k in enumerate(keys)]))
    side.drain()
    side.report()
    engine.hold()
    for i, key in enumerate(keys):
        load = RequestLoad(f"r{i}", (ChunkLoad(key, (10, 11), 0, host_slot=3 + i, disk_slot=i),),
                           asynchronous=True)
        side.start_loads(StepPlan(loads=[load]))
        wait_until(lambda i=i: f"r{i}" in side.finished(), "a hung read held the request")
    report = side.report()
    assert report.paths_down == Counter({0: 1}) and sum(report.reads_stalled.values()) == 3
    assert not report.load_samples  # cut short: no measure of the disk's speed
    engine.release()
    side.close()


def test_a_load_stuck_behind_its_write_back_is_given_up(tmp_path):
    from kvtier.connector.common.messages import DiskWrite

    side, _, engine = worker_and_engine(tmp_path, load_timeout=0.2)
    side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (2, 3), 1, disk_slot=0)]))
    side.drain()
    side.report()
    before = engine.submitted["disk0"]
    engine.hold()
    load = RequestLoad("r", (ChunkLoad(b"a" * 16, (10, 11), 0, host_slot=0, disk_slot=0),),
                       demotions=(DiskWrite(b"v" * 16, host_slot=0, disk_slot=3),),
                       asynchronous=True)
    side.start_loads(StepPlan(loads=[load]))
    wait_until(lambda: side.finished() == {"r"}, "a hung write-back held the request")
    assert side.take_invalid_blocks() == {10, 11}
    report = side.report()
    assert report.reads_stalled[b"a" * 16] == 1 and not report.reads_over
    engine.release()
    seen: dict = {}
    wait_until(lambda: outcomes(side, seen).get("reads_over"), "the staging slot stayed taken")
    assert seen["reads_over"][b"a" * 16] == 1 and seen["disk_written"][b"v" * 16] == 1
    assert engine.submitted["disk0"] == before + 1  # the write-back only: no read started
    side.close()


def test_a_load_given_up_as_its_reads_start_leaves_a_later_load_of_its_request_whole(tmp_path):
    """Given up on (load_timeout) just after its job was let start its reads, a load must not
    stop the next load of the same request from reading: that one would copy its staging
    slot's previous chunk into the pages."""
    import threading

    from kvtier.connector.common.messages import DiskWrite

    side, kv, _ = worker_and_engine(tmp_path, load_timeout=0.2, write_policy="write_back")
    original = [t.clone() for t in kv]
    side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (2, 3), host_slot=1, disk_slot=0),
                               ChunkStore(b"c" * 16, (6, 7), host_slot=4)]))
    side.drain()
    side.report()
    entered, go = threading.Event(), threading.Event()
    submit_reads = side._disk.submit_reads

    def slow_submit(load):  # the job is past its gate, its reads not yet started
        entered.set()
        go.wait(10)
        return submit_reads(load)

    side._disk.submit_reads = slow_submit
    first = RequestLoad("r", (ChunkLoad(b"a" * 16, (10, 11), 0, host_slot=2, disk_slot=0),),
                        demotions=(DiskWrite(b"v" * 16, host_slot=2, disk_slot=3),),
                        asynchronous=True)
    side.start_loads(StepPlan(loads=[first]))
    assert entered.wait(10)
    wait_until(lambda: side.finished() == {"r"}, "the load was not given up")
    assert side.take_invalid_blocks() == {10, 11}
    side._disk.submit_reads = submit_reads
    go.set()
    seen: dict = {}
    wait_until(lambda: outcomes(side, seen).get("reads_over"), "the late read never ended")
    # the request again, its chunk staged in a slot whose chunk "c" is written back first
    second = RequestLoad("r", (ChunkLoad(b"a" * 16, (12, 13), 0, host_slot=4, disk_slot=0),),
                         demotions=(DiskWrite(b"c" * 16, host_slot=4, disk_slot=5),),
                         asynchronous=True)
    side.start_loads(StepPlan(loads=[second]))
    wait_until(lambda: "r" in side.finished(), "the second load never ended")
    assert side.take_invalid_blocks() == set()
    assert all(same(kv[i][12:14], original[i][2:4]) for i in range(LAYERS))
    side.close()


def test_a_store_behind_a_write_back_on_a_hung_drive_is_dropped_after_load_timeout(tmp_path):
    """vLLM's step (``wait_for_save``) must not wait on a hung drive past load_timeout: the
    store into the slot its write-back still reads is dropped, the slot left as it is."""
    import threading

    from kvtier.connector.common.messages import DiskWrite

    side, _, engine = worker_and_engine(tmp_path, load_timeout=0.2, write_policy="write_back")
    side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (2, 3), host_slot=1)]))  # host only
    side.report()
    before = side.host.slot(1).clone()
    engine.hold()
    plan = StepPlan(demotions=[DiskWrite(b"a" * 16, host_slot=1, disk_slot=0)],
                    stores=[ChunkStore(b"b" * 16, (4, 5), host_slot=1),
                            ChunkStore(b"c" * 16, (6, 7), host_slot=2)])
    saved = threading.Event()
    threading.Thread(target=lambda: (side.save(plan), saved.set()), daemon=True).start()
    try:
        assert saved.wait(10), "the step waited on the hung drive"
        report = side.report()
        assert report.host_failed == Counter({b"b" * 16: 1})
        assert report.host_stored == Counter({b"c" * 16: 1})
        assert torch.equal(side.host.slot(1), before)  # chunk "a" is still being written
    finally:
        engine.release()
    seen: dict = {}
    wait_until(lambda: outcomes(side, seen).get("disk_written"), "the write-back never ended")
    assert seen["disk_written"] == Counter({b"a" * 16: 1})
    side.close()


def test_shutdown_on_a_hung_drive_returns_in_time(tmp_path, caplog):
    import logging

    from kvtier.connector.common.messages import DiskWrite

    side, _, engine = worker_and_engine(tmp_path, load_timeout=60)
    side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (2, 3), 1, disk_slot=0)]))
    side.drain()
    engine.hold()
    side.save(StepPlan(stores=[ChunkStore(bytes([i]) * 16, (4, 5), 2 + i, disk_slot=1 + i)
                                     for i in range(3)]))  # background writes that hang
    load = RequestLoad("r", (ChunkLoad(b"a" * 16, (10, 11), 0, host_slot=0, disk_slot=0),),
                       demotions=(DiskWrite(b"v" * 16, host_slot=0, disk_slot=6),),
                       asynchronous=True)  # a load stuck behind its write-back
    side.start_loads(StepPlan(loads=[load]))
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        assert side.close(timeout=0.3) is False
    assert time.monotonic() - started < 5
    assert any("hung drive" in r.getMessage() for r in caplog.records)
    assert not side.disk.paths[0].dir.closed and side.host.buffer.array is not None
    engine.release()
    assert side.close()


def test_shutdown_finishes_background_writes_first(tmp_path):
    side, _ = worker(tmp_path)
    side.save(StepPlan(stores=[ChunkStore(bytes([i]) * 16, (4, 5), i, disk_slot=i)
                                     for i in range(4)]))
    assert side.close() is True
    assert side.report().disk_written.total() == 4 and side.disk.paths[0].dir.closed


def test_a_write_through_job_that_raises_reports_its_chunk_failed_once(tmp_path, monkeypatch):
    """Anything but an I/O result out of a write job (out of memory in a codec's buffers)
    still gives each chunk one outcome: without one, the scheduler side would keep its host
    slot pinned for good."""
    side, _ = worker(tmp_path)

    def broken(items, records=None):
        raise MemoryError("no memory for the codec's buffer")

    monkeypatch.setattr(side.disk, "write_many", broken)
    side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (2, 3), host_slot=1, disk_slot=0)]))
    side.drain()
    report = side.report()
    assert report.host_stored[b"a" * 16] == 1
    assert (report.disk_written[b"a" * 16], report.disk_failed[b"a" * 16]) == (0, 1)
    side.close()


def test_each_demotion_has_one_outcome_when_one_paths_job_raises(tmp_path, monkeypatch):
    """Write-back demotions over two disk paths, one path's job raising: the chunk written
    on the other path is reported written only (told both, one rank would count as every
    rank of a TP group, and its slots be freed while another rank still writes them)."""
    from kvtier.connector.common.messages import DiskWrite

    side, _ = worker(tmp_path, paths=2, write_policy="write_back")
    a, b = b"a" * 16, b"b" * 16
    side.save(StepPlan(stores=[ChunkStore(a, (2, 3), host_slot=0), ChunkStore(b, (4, 5), host_slot=1)]))
    side.report()
    real = side.disk.write_many

    def half_broken(items, records=None):
        if any(slot % 2 for slot, _, _ in items):  # path 1's job
            raise MemoryError("no memory for a scratch buffer")
        return real(items, records)

    monkeypatch.setattr(side.disk, "write_many", half_broken)
    side.save(StepPlan(demotions=[DiskWrite(a, host_slot=0, disk_slot=0),
                                  DiskWrite(b, host_slot=1, disk_slot=1)]))
    side.drain()
    report = side.report()
    assert (report.disk_written[a], report.disk_failed[a]) == (1, 0)
    assert (report.disk_written[b], report.disk_failed[b]) == (0, 1)
    side.close()


def test_each_write_has_one_outcome_when_one_paths_job_cannot_be_submitted(tmp_path, monkeypatch):
    """Write-through over two disk paths, the second path's job refused at its submit (the
    engine closing): every chunk was reported failed, the first path's too, whose job then
    reported it written as well. Each is told once now. Found by a review."""
    side, _ = worker(tmp_path, paths=2)
    lane = side._lane
    submit = lane.submit

    def refuse_the_second_path(queue, job):
        if queue.endswith("1"):
            raise RuntimeError("cannot schedule new futures after shutdown")
        return submit(queue, job)

    monkeypatch.setattr(lane, "submit", refuse_the_second_path)
    a, b = b"a" * 16, b"b" * 16
    side.save(StepPlan(stores=[ChunkStore(a, (2, 3), host_slot=0, disk_slot=0),
                               ChunkStore(b, (4, 5), host_slot=1, disk_slot=1)]))
    side.drain()
    report = side.report()
    assert (report.disk_written[a], report.disk_failed[a]) == (1, 0)
    assert (report.disk_written[b], report.disk_failed[b]) == (0, 1)
    side.close()


def test_close_is_bounded_when_the_mount_hangs_with_no_job_in_flight(tmp_path, monkeypatch):
    """An idle engine whose mount hung (NVMe-oF, NFS): its jobs drain at once, but closing
    the paths writes each lease's last word on the dead mount. close(timeout) returns in
    time all the same, saying it did not close."""
    import os
    import threading

    side, _ = worker(tmp_path)
    real_rename, release = os.rename, threading.Event()

    def hung_rename(src, dst, *args, **kwargs):  # every metadata operation on it blocks
        release.wait(20)
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", hung_rename)
    outcome: list = []
    closer = threading.Thread(target=lambda: outcome.append(side.close(timeout=0.3)), daemon=True)
    closer.start()
    closer.join(5)
    try:
        assert not closer.is_alive(), "close(timeout=0.3) hung on the mount"
    finally:
        release.set()
        closer.join(30)


def test_a_failed_host_load_fails_every_store_of_its_step_and_the_next(tmp_path, monkeypatch):
    """The forward of the step ran over the pages the failed copy left unfilled: what it
    computed over them is wrong (vLLM recomputes it), in that request and in any other whose
    prefix hit in vLLM's cache shares those blocks (vLLM caches a synchronous load's blocks
    as it allocates them); with asynchronous scheduling the next step was planned before
    the failure was told. Every store of those two steps fails; the step after stores."""
    from kvtier.connector.worker.pages import PagedKV

    side, _ = worker(tmp_path, disk=False)
    side.save(StepPlan(stores=[ChunkStore(b"h" * 16, (1, 2), host_slot=2)]))
    side.report()
    scatter = PagedKV.scatter

    def broken(self, slot, block_ids, first):  # a copy that raises (a device error, say)
        raise RuntimeError("the copy failed")

    monkeypatch.setattr(PagedKV, "scatter", broken)
    plan = StepPlan(loads=[RequestLoad("r", (ChunkLoad(b"h" * 16, (7, 8), 0, 2),))],
                    stores=[ChunkStore(b"n" * 16, (9, 10), host_slot=3, req_id="r"),
                            ChunkStore(b"o" * 16, (11, 12), host_slot=4, req_id="sharer")])
    side.start_loads(plan)  # before the forward: fails
    side.save(plan)  # after it
    assert side.finished() == set() and side.take_invalid_blocks() == {7, 8}
    report = side.report()
    assert report.host_failed[b"n" * 16] == 1 and not report.host_stored[b"n" * 16]
    assert report.host_failed[b"o" * 16] == 1 and not report.host_stored[b"o" * 16]
    monkeypatch.setattr(PagedKV, "scatter", scatter)
    side.save(StepPlan(stores=[ChunkStore(b"p" * 16, (13, 14), host_slot=5, req_id="sharer")]))
    assert side.report().host_failed[b"p" * 16] == 1  # planned before the failure was told
    side.save(StepPlan(stores=[ChunkStore(b"n" * 16, (9, 10), host_slot=3, req_id="r")]))
    assert side.report().host_stored[b"n" * 16] == 1  # the step after stores again
    side.close()


def test_an_asynchronous_loads_copy_waits_for_what_came_before_its_start(tmp_path, monkeypatch):
    """On CUDA a load's copy into pages waits for the compute stream: a host hit for all it
    has queued (vLLM's zeroing of the new blocks comes just before), a disk hit, copied
    in a later step while that step's forward runs, only for what was queued when the load
    started (``PagedKV.mark``): not for that forward. The mark's way through, on the CPU."""
    from kvtier.connector.worker.pages import PagedKV

    side, _ = worker(tmp_path)
    side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (2, 3), host_slot=0, disk_slot=0)]))
    side.drain()
    side.report()
    marks, seen = iter(["mark-1", "mark-2"]), []
    scatter = PagedKV.scatter
    monkeypatch.setattr(PagedKV, "mark", lambda self: next(marks))

    def recording(self, slot, block_ids, first, after=None):
        seen.append(after)
        return scatter(self, slot, block_ids, first, after if after is None else None)

    monkeypatch.setattr(PagedKV, "scatter", recording)
    disk_hit = RequestLoad("d", (ChunkLoad(b"a" * 16, (8, 9), 0, host_slot=1, disk_slot=0),),
                           asynchronous=True)
    side.start_loads(StepPlan(loads=[disk_hit]))
    side.drain()
    assert side.finished() == {"d"} and seen == ["mark-1"]
    side.start_loads(StepPlan(loads=[RequestLoad("h", (ChunkLoad(b"a" * 16, (10, 11), 0, 1),))]))
    assert seen == ["mark-1", None]  # a host hit: after all the compute stream has queued
    side.close()


def test_writes_are_stamped_in_the_order_the_scheduler_planned_them(tmp_path):
    """A write's generation follows the plans' order even when a later step's write job
    runs first: ``kvtier gc`` reads a prompt's order (head before tail) from them."""
    side, _, engine = worker_and_engine(tmp_path)
    engine.hold()
    side.save(StepPlan(stores=[ChunkStore(b"a" * 16, (2, 3), host_slot=0, disk_slot=0)]))
    side.save(StepPlan(stores=[ChunkStore(b"b" * 16, (4, 5), host_slot=1, disk_slot=1)]))
    engine.release_last_first("disk0", 2)
    side.drain()
    headers = dict(side.disk.scan_headers([0, 1])[0])
    assert headers[0].generation < headers[1].generation
    assert headers[0].created_ns <= headers[1].created_ns
    side.close()
