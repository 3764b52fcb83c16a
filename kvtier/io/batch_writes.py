"""Group commit of one path's disk writes: chunks queued while that path's write jobs are
busy go to the disk together, in one job (neighbouring slots in one vectored call), each
with its own future, settled by the job itself."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Generic, TypeVar

from kvtier.io.batch_reads import READ_GROUP_BYTES
from kvtier.io.guarded import cancel
from kvtier.io.result import IOResult, IOStatus

# the chunks of one write job, at most (at least one chunk), as for reads
WRITE_GROUP_BYTES = READ_GROUP_BYTES

T = TypeVar("T")
# the owner's bookkeeping of a group's items once over: their results, or None when the
# write never ran (the engine closed): nothing to count then
Settle = Callable[[Sequence[T], Sequence[IOResult] | None], None]


@dataclass
class WriteGroup(Generic[T]):
    """Items written by one job, in one ``write`` call, and their futures."""

    items: list[T] = field(default_factory=list)
    futures: list[Future[IOResult]] = field(default_factory=list)
    settled: bool = False
    began: float | None = None  # when a job was given it (monotonic)
    job: Future | None = None  # the job submitted for it (None: a running job took it)


class WriteGroups(Generic[T]):
    """The writes of one path, in groups of at most ``per_group`` items, run by at most
    ``jobs`` jobs at a time.

    Contract:

    - ``add(item)`` never blocks and calls nothing back, so the caller may hold its locks.
      It returns the item's future and, when no job is free to take it later, the group it
      opened: the caller passes that group to ``start`` once it holds no lock ``settle``
      takes. Otherwise the item waits in a group until a running job is over with its own:
      a job writes the groups waiting for it before it ends, so a drain of the engine that
      sees the jobs over sees every item added before it over.
    - A job runs ``write(items)`` (one ``IOResult`` per item; an exception fails the group),
      then ``settle(items, results)``, then the items' futures: whoever sees the job over
      sees its items settled. A job the engine fails before it runs fails its group the
      same way, from the job's done callback (so just after a drain may see it over), and a
      new job takes the groups waiting. A job cancelled (the engine closed), or one
      ``submit`` refuses, settles its group and those waiting with None; once the engine
      takes no more jobs, a running job drops the groups waiting instead of writing them.
    - ``pending`` counts the items added and not settled (back-pressure); ``waiting`` those
      not in a job yet.
    - ``stalled(timeout)`` names an item of a group given to a job ``timeout`` or more ago
      and not over (a hung drive), if any; ``fail_waiting(result)`` settles every group waiting
      for a job with ``result`` and cancels the jobs queued and not started (its path out of
      service: they would wait for a hung job).
    """

    def __init__(self, submit: Callable[[Callable[[], None]], Future],
                 write: Callable[[list[T]], list[IOResult]], settle: Settle[T], per_group: int,
                 jobs: int, closed: Callable[[], bool]) -> None:
        self._submit, self._write, self._settle = submit, write, settle
        self._closed = closed  # whether the engine takes no more jobs
        self._per_group, self._jobs = max(1, per_group), max(1, jobs)
        self._lock = threading.Lock()
        self._waiting: deque[WriteGroup[T]] = deque()
        self._running = 0  # jobs submitted and not over; a group waits only when all are taken
        self._pending = 0
        self._groups: dict[int, WriteGroup[T]] = {}  # given to a job and not over, by id

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def waiting(self) -> int:
        """Items added and not in a job yet."""
        with self._lock:
            return sum(len(group.items) for group in self._waiting)

    def add(self, item: T) -> tuple[Future[IOResult], WriteGroup[T] | None]:
        """Queue ``item``: its future, and the group to ``start`` if it opened one."""
        future: Future[IOResult] = Future()
        with self._lock:
            self._pending += 1
            if self._running < self._jobs:
                self._running += 1
                return future, WriteGroup([item], [future])
            if not self._waiting or len(self._waiting[-1].items) >= self._per_group:
                self._waiting.append(WriteGroup())
            self._waiting[-1].items.append(item)
            self._waiting[-1].futures.append(future)
        return future, None

    def start(self, group: WriteGroup[T]) -> None:
        """Submit the job of a group ``add`` returned; re-raises when ``submit`` refuses,
        after settling that group and those waiting (never written)."""
        with self._lock:
            self._out(group)
        try:
            job = self._submit(partial(self._run, group))
        except BaseException:
            self.abandon(group)
            raise
        group.job = job
        job.add_done_callback(partial(self._ended, group))

    def _run(self, group: WriteGroup[T] | None) -> None:
        """The job: write ``group``, then the groups waiting, until none is left."""
        while group is not None:
            try:
                results = self._write(group.items)
            except Exception as exc:  # a bug, or an unexpected error: a failed write
                results = [IOResult(IOStatus.IO_ERROR, detail=repr(exc))] * len(group.items)
            self._over(group, results)
            group = self._next()

    def _out(self, group: WriteGroup[T]) -> WriteGroup[T]:
        """``group`` handed to a job now (lock held)."""
        group.began = time.monotonic()
        self._groups[id(group)] = group
        return group

    def stalled(self, timeout: float) -> T | None:
        """An item of a group handed to a job ``timeout`` or more seconds ago and not over
        (its job queued or writing), if any."""
        now = time.monotonic()
        with self._lock:
            return next((group.items[0] for group in self._groups.values()
                         if group.began is not None and now - group.began >= timeout), None)

    def fail_waiting(self, result: IOResult) -> int:
        """Settle every group waiting for a job with ``result``, and cancel the jobs the
        engine holds queued, not started (their groups settle as never run); the items
        settled here."""
        with self._lock:
            dropped = list(self._waiting)
            self._waiting.clear()
            queued = [group.job for group in self._groups.values() if group.job is not None]
        for group in dropped:
            self._over(group, [result] * len(group.items))
        for job in queued:
            cancel(job)  # only one not running yet is: ``_ended`` gives its group back
        return sum(len(group.items) for group in dropped)

    def _next(self) -> WriteGroup[T] | None:
        """The next group waiting for a job; None, and one job fewer, when none waits or the
        engine closed meanwhile (then the groups waiting are dropped, as it drops the jobs
        it had queued)."""
        with self._lock:
            if not self._waiting:
                self._running -= 1
                return None
        if self._closed():
            with self._lock:
                dropped = list(self._waiting)
                self._waiting.clear()
                self._running -= 1
            for group in dropped:
                self._over(group, None)
            return None
        with self._lock:  # another job may have taken the last one meanwhile
            if self._waiting:
                return self._out(self._waiting.popleft())
            self._running -= 1
            return None

    def _over(self, group: WriteGroup[T], results: Sequence[IOResult] | None) -> None:
        """Settle ``group`` (once), then its futures."""
        if group.settled:
            return
        group.settled = True
        try:
            self._settle(group.items, results)
        finally:
            for i, future in enumerate(group.futures):
                future.set_result(results[i] if results is not None else _NOT_RUN)
            with self._lock:
                self._pending -= len(group.items)
                self._groups.pop(id(group), None)

    def _ended(self, group: WriteGroup[T], job: Future) -> None:
        """A job is over. One cancelled never ran; one that raised (failed by the engine
        before it ran, or a bug) hands the groups waiting to a new job."""
        if job.cancelled():
            self.abandon(group)  # never submit here: cancelling runs inside the engine's close
            return
        error = job.exception()
        if error is None:
            return
        self._over(group, [IOResult(IOStatus.IO_ERROR, detail=repr(error))] * len(group.items))
        following = self._next()
        if following is not None:
            with contextlib.suppress(BaseException):  # closed meanwhile: start settled what waited
                self.start(following)

    def abandon(self, group: WriteGroup[T]) -> None:
        """``group`` (one ``add`` returned, never started) and every group waiting never run:
        settle them with None."""
        with self._lock:
            dropped = [group, *self._waiting]
            self._waiting.clear()
            self._running -= 1
        for each in dropped:
            self._over(each, None)


_NOT_RUN = IOResult(IOStatus.IO_ERROR, detail="write not run: the I/O engine closed")
