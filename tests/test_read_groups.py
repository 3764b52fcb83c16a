"""Starting batched reads under one rule (kvtier/io/batch_reads.py ``start_groups``): every
chunk gets its future; a group whose job cannot start fails with every later one."""

from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.io.batch_reads import ReadGroup, start_groups
from kvtier.io.result import IOResult, IOStatus


def ok_reads(count: int):
    return lambda: [IOResult(IOStatus.OK, nbytes=1) for _ in range(count)]


class Lane:
    """Runs jobs on a thread; refuses every job from the ``refuse_from``-th on."""

    def __init__(self, refuse_from: int = 99, error: BaseException | None = None) -> None:
        self.pool, self.seen = ThreadPoolExecutor(1), 0
        self.refuse_from = refuse_from
        self.error = error or RuntimeError("the lane is closed")

    def submit(self, job) -> Future:
        self.seen += 1
        if self.seen > self.refuse_from:
            raise self.error
        return self.pool.submit(job)


def test_every_group_started_settles_its_chunks_in_order():
    lane = Lane()
    started = start_groups([ReadGroup(2, ok_reads(2), lane.submit),
                            ReadGroup(3, ok_reads(3), lane.submit)])
    assert started.refused is None and len(started.jobs) == 2
    assert [f.result(timeout=10).ok for f in started.reads] == [True] * 5


def test_a_refused_group_fails_with_every_later_one_and_the_earlier_run_on():
    lane = Lane(refuse_from=1)
    started = start_groups([ReadGroup(1, ok_reads(1), lane.submit),
                            ReadGroup(2, ok_reads(2), lane.submit),
                            ReadGroup(1, ok_reads(1), lane.submit)])
    assert isinstance(started.refused, RuntimeError)
    assert lane.seen == 2  # nothing more is offered to a lane that refused
    results = [f.result(timeout=10) for f in started.reads]
    assert results[0].ok
    assert [r.status for r in results[1:]] == [IOStatus.IO_ERROR] * 3
    assert all("the lane is closed" in r.detail for r in results[1:])


def test_a_job_that_raises_fails_its_own_chunks():
    def broken():
        raise OSError("EIO")

    lane = Lane()
    started = start_groups([ReadGroup(2, broken, lane.submit), ReadGroup(1, ok_reads(1), lane.submit)])
    results = [f.result(timeout=10) for f in started.reads]
    assert [r.ok for r in results] == [False, False, True]
    assert "EIO" in results[0].detail


def test_an_interrupt_is_handed_back_with_every_chunk_settled():
    error = KeyboardInterrupt()
    lane = Lane(refuse_from=0, error=error)
    started = start_groups([ReadGroup(1, ok_reads(1), lane.submit)])
    assert started.refused is error
    assert started.reads[0].done() and not started.reads[0].result().ok
