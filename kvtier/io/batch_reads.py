"""The per-chunk futures of one batched disk read, settled by the read job itself."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

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
