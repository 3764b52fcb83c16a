"""Batched reads: the per-chunk futures of one read job, settled by the job itself, and
the starting of a batch of such jobs under one rule (``start_groups``)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

from kvtier.io.result import IOResult, IOStatus

# the chunks of one batched read job, at most (at least one chunk): small chunks read one by
# one lose more to the hand-offs between threads than they gain in parallel
READ_GROUP_BYTES = 8 * 2**20


class BatchReads:
    """The per-chunk futures of one batched read. The read job settles them itself before
    it returns, so whoever sees the job over (a drain of the engine) sees them over too;
    all fail if the job raises or is cancelled before it runs."""

    def __init__(self, count: int) -> None:
        self.items: list[Future[IOResult]] = [Future() for _ in range(count)]

    def run(self, read: Callable[[], list[IOResult]]) -> list[IOResult]:
        """Run ``read`` (in the job) and settle the items with its results."""
        try:
            results = read()
        except BaseException as exc:
            self.fail(repr(exc))
            raise
        for item, result in zip(self.items, results, strict=True):
            item.set_result(result)
        return results

    def watch(self, job: Future) -> None:
        """Fail the items if ``job`` is cancelled (it will never run) or ends in an error
        without settling them (raised before ``run`` ran: an engine's own failure)."""
        def over(done: Future) -> None:
            if done.cancelled():
                self.fail("read cancelled")
            elif done.exception() is not None:
                self.fail(f"read job failed: {done.exception()!r}")

        job.add_done_callback(over)

    def fail(self, detail: str) -> None:
        """Fail every item not settled yet."""
        for item in self.items:
            if not item.done():
                item.set_result(IOResult(IOStatus.IO_ERROR, detail=detail))


Read = Callable[[], list[IOResult]]


@dataclass(frozen=True)
class ReadGroup:
    """One read job: ``count`` chunks read by ``read`` (on an I/O thread), started by
    ``submit`` (a lane's: it returns the job's future, or raises when it cannot run it)."""

    count: int
    read: Read
    submit: Callable[[Read], Future]


@dataclass(frozen=True)
class Started:
    """What ``start_groups`` started: a future per chunk (the groups' chunks in order), the
    jobs that run, and the refusal that stopped the rest (None: every group started)."""

    reads: list[Future[IOResult]]
    jobs: list[Future]
    refused: BaseException | None


def start_groups(groups: list[ReadGroup]) -> Started:
    """Start each group's job, in order. The one rule of every batched read: each chunk
    gets its future, settled by its job; a group whose job cannot start (a lane closed, or
    its engine failed) fails, and every later group with it, naming the refusal, while the
    jobs already started run on. Whether the refusal is raised is the caller's to say."""
    reads: list[Future[IOResult]] = []
    jobs: list[Future] = []
    refused: BaseException | None = None
    for group in groups:
        batch = BatchReads(group.count)
        reads += batch.items
        if refused is not None:
            batch.fail(f"not started: {refused!r}")
            continue
        try:
            job = group.submit(partial(batch.run, group.read))
        except BaseException as exc:  # an interrupt too: no chunk is left without its read
            refused = exc
            batch.fail(f"not started: {exc!r}")
            continue
        batch.watch(job)
        jobs.append(job)
    return Started(reads, jobs, refused)
