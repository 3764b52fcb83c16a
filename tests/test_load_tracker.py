"""The worker's load tracker: loads in flight as futures, given up on after their timeout,
their late reads released once each when they end."""

from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from kvtier.connector.common.messages import ChunkLoad, RequestLoad
from kvtier.connector.worker.load_tracker import LoadTracker, ReadGate, resolved, when_all_over
from kvtier.io.batch_reads import BatchReads
from kvtier.io.result import IOResult, IOStatus

OK = IOResult(IOStatus.OK, 8)


def load(*keys: bytes) -> RequestLoad:
    return RequestLoad("r", tuple(ChunkLoad(k, (i,), 0, host_slot=i, disk_slot=i)
                                  for i, k in enumerate(keys)), asynchronous=True)


def test_batch_reads_are_settled_before_their_job_is_over():
    reads = BatchReads(2)
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(reads.run, lambda: [OK, IOResult(IOStatus.CORRUPT)])
        job.result(5)
        assert [f.done() for f in reads.items] == [True, True]  # no callback to wait for
    assert [f.result().status for f in reads.items] == [IOStatus.OK, IOStatus.CORRUPT]


def test_batch_reads_fail_when_the_job_raises_or_is_cancelled():
    raised = BatchReads(2)
    with pytest.raises(OSError):
        raised.run(lambda: (_ for _ in ()).throw(OSError(5, "EIO")))
    assert all(f.result().status is IOStatus.IO_ERROR for f in raised.items)
    cancelled, job = BatchReads(1), Future()
    cancelled.watch(job)
    job.cancel()
    assert cancelled.items[0].result().status is IOStatus.IO_ERROR


def test_a_load_is_ready_once_when_its_reads_are_over():
    tracker, read = LoadTracker(timeout=None), Future()
    tracker.add(load(b"a"), resolved({b"a": read}), started=0.0)
    assert tracker.ready(now=1e9) == []  # no timeout: waits as long as it takes
    read.set_result(OK)
    (ready,) = tracker.ready(now=1.0)
    assert ready.reads[b"a"].result() is OK and not ready.late and ready.error is None
    assert tracker.ready(now=2.0) == [] and tracker.jobs() == []


def test_a_read_past_the_timeout_is_late_and_released_once_when_it_ends():
    tracker, slow, fast = LoadTracker(timeout=1.0), Future(), resolved(OK)
    tracker.add(load(b"a", b"b"), resolved({b"a": fast, b"b": slow}), started=0.0)
    assert tracker.ready(now=0.5) == []
    (ready,) = tracker.ready(now=1.0)
    assert ready.late == {b"b"} and ready.late_slots == [1]
    assert ready.reads[b"b"].result().status is IOStatus.TIMED_OUT and ready.reads[b"a"] is fast
    assert tracker.released() == []  # still filling its staging slot
    slow.set_result(IOResult(IOStatus.IO_ERROR))
    assert [(k, r.status, remote) for k, r, remote in tracker.released()] == [
        (b"b", IOStatus.IO_ERROR, False)]
    assert tracker.released() == []


def test_a_load_whose_job_has_not_run_is_abandoned_and_never_reads():
    tracker, job, gate = LoadTracker(timeout=1.0), Future(), ReadGate()
    tracker.add(load(b"a"), job, started=0.0, gate=gate)
    (ready,) = tracker.ready(now=1.0)
    assert ready.late == {b"a"} and ready.late_slots == []  # nothing was asked of the disk
    assert not gate.open() and not gate.open()  # this load's job: never
    assert ReadGate().open()  # another load of the same request reads
    assert tracker.released() == []  # the job may still use the staging slot
    job.set_result({})
    assert [k for k, _, _ in tracker.released()] == [b"a"]


def test_a_load_given_up_once_its_reads_started_waits_for_them():
    tracker, job, gate = LoadTracker(timeout=1.0), Future(), ReadGate()
    tracker.add(load(b"a"), job, started=0.0, gate=gate)
    assert gate.open()  # the job starts its reads first
    (ready,) = tracker.ready(now=1.0)
    assert ready.late == {b"a"} and gate.open()  # decided once: the reads go on
    read: Future = Future()
    job.set_result({b"a": read})
    assert tracker.released() == []  # the read still fills the staging slot
    read.set_result(OK)
    assert [k for k, _, _ in tracker.released()] == [b"a"]


def test_a_job_that_raised_fails_every_disk_chunk_of_its_load():
    tracker, job = LoadTracker(timeout=None), Future()
    job.set_exception(RuntimeError("no reads"))
    tracker.add(load(b"a", b"b"), job, started=0.0)
    (ready,) = tracker.ready(now=0.0)
    assert isinstance(ready.error, RuntimeError)
    assert {k: r.result().status for k, r in ready.reads.items()} == {
        b"a": IOStatus.IO_ERROR, b"b": IOStatus.IO_ERROR}


def test_when_all_over_waits_for_the_job_and_each_read_it_started():
    job, read = Future(), Future()
    over = when_all_over(job)
    job.set_result({b"a": read})
    assert not over.done()
    read.set_result(OK)
    assert over.result(1).ok


def test_a_late_remote_read_is_released_as_remote_not_as_a_disk_path_failure():
    tracker, slow = LoadTracker(timeout=1.0), Future()
    remote = RequestLoad("r", (ChunkLoad(b"a", (0,), 0, host_slot=0, remote=True),), asynchronous=True)
    tracker.add(remote, resolved({b"a": slow}), started=0.0)
    (ready,) = tracker.ready(now=1.0)
    assert ready.late == {b"a"} and ready.late_slots == []  # no disk slot took a timeout
    slow.set_result(IOResult(IOStatus.PATH_DOWN))
    assert [(k, r.status, remote) for k, r, remote in tracker.released()] == [
        (b"a", IOStatus.PATH_DOWN, True)]
