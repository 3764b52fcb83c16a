"""Asynchronous loads in flight on one worker, as futures: the loads waiting for their disk
reads, the reads given up on (``load_timeout``) that still fill their staging slots, and the
loads given up on before their reads started.

Every outcome is a ``concurrent.futures.Future``: a read is a ``Future[IOResult]``, a load's
reads are the ``Future`` of a dict of them (available at once, or when a write-back that
must come first is over).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvtier.connector.common.messages import RequestLoad
from kvtier.io.result import IOResult, IOStatus

Reads = dict[bytes, "Future[IOResult]"]  # a load's disk reads, by chunk key


def resolved(value: object) -> Future:
    """A future that is already over, with ``value``."""
    future: Future = Future()
    future.set_result(value)
    return future


def failed_read(detail: str, status: IOStatus = IOStatus.IO_ERROR) -> Future[IOResult]:
    """A read that could not be started, or was given up on."""
    return resolved(IOResult(status, detail=detail))


def when_all_over(job: Future[Reads]) -> Future[IOResult]:
    """Over (OK) once ``job`` and every read it started are over."""
    over: Future[IOResult] = Future()

    def job_done(done: Future[Reads]) -> None:
        try:
            reads = list(done.result().values())
        except BaseException:  # no read started
            reads = []
        after_all(reads, lambda: over.set_result(IOResult(IOStatus.OK)))

    job.add_done_callback(job_done)
    return over


def after_all(futures: list[Future], then: Callable[[], None]) -> None:
    """``then()`` once every one of ``futures`` is over (at once when none is), on the
    thread that settled the last."""
    if not futures:
        then()
        return
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for future in futures:
        future.add_done_callback(one_done)


@dataclass
class ReadyLoad:
    """A load whose reads are over, or given up on: ``reads`` are all done. ``late`` are the
    keys whose reads were given up after ``load_timeout`` (they still run: their staging
    slots stay taken until ``released`` reports them), on the disk slots ``late_slots``;
    ``error`` is why the reads could not start."""

    load: RequestLoad
    reads: Reads
    started: float
    late: set[bytes] = field(default_factory=set)
    late_slots: list[int] = field(default_factory=list)
    error: BaseException | None = None
    after: object = None  # what its copies into pages wait for (``PagedKV.mark``)


class ReadGate:
    """Whether a load's job may start its reads, decided once by whichever comes first: the
    job about to start them (``open``), or the step thread giving the load up (``close``).
    One per load, so a load given up on never bears on a later load of the same request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reads: bool | None = None  # None until decided

    def open(self) -> bool:
        """The job, before its reads: True unless the load was given up on first."""
        with self._lock:
            if self._reads is None:
                self._reads = True
            return self._reads

    def close(self) -> None:
        """The step thread, giving the load up: reads not started by now never will be."""
        with self._lock:
            if self._reads is None:
                self._reads = False


@dataclass
class _Pending:
    load: RequestLoad
    job: Future[Reads]
    started: float
    gate: ReadGate
    after: object = None


class LoadTracker:
    """The asynchronous loads of one worker between ``start_load`` and their completion.

    Contract:

    - ``add(load, job, started, gate)`` tracks a load whose reads ``job`` starts (its value:
      the reads by key), asking ``gate.open()`` first when it must wait (a write-back).
      Called from the engine's step thread only, as is ``ready``.
    - ``ready(now)`` returns the loads whose reads are all over, or whose ``timeout`` is up,
      each once. A load whose reads run past the timeout comes back with those reads failed
      (TIMED_OUT) and listed in ``late``; a load whose write-back was still running comes
      back with every staged chunk failed and late, and its reads will not start if they
      have not yet (its ``gate`` says so to the job).
    - ``released()`` returns, once each, the late reads that have ended since, with what
      they came to and whether they were from the remote store: only then may their
      staging slots be reused.
    - ``jobs()`` are the load jobs still running (closing waits for them).
    """

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self._pending: list[_Pending] = []
        # reads given up on that still run: key, read, whether from the remote store
        self._stalled: list[tuple[bytes, Future[IOResult], bool]] = []

    def add(self, load: RequestLoad, job: Future[Reads], started: float,
            gate: ReadGate | None = None, after: object = None) -> None:
        self._pending.append(_Pending(load, job, started, gate or ReadGate(), after))

    def ready(self, now: float) -> list[ReadyLoad]:
        waiting, ready = [], []
        for pending in self._pending:
            over = self._over(pending, now)
            if over is None:
                waiting.append(pending)
            else:
                ready.append(over)
        self._pending = waiting
        return ready

    def _over(self, pending: _Pending, now: float) -> ReadyLoad | None:
        timed_out = self.timeout is not None and now - pending.started >= self.timeout
        if not pending.job.done():
            return self._abandon(pending) if timed_out else None
        load, error = pending.load, None
        try:
            reads = pending.job.result()
        except Exception as exc:  # the reads could not start: every disk chunk failed
            error = exc
            reads = {c.key: failed_read(repr(exc)) for c in load.chunks if c.staged}
        late = {key for key, read in reads.items() if not read.done()}
        if late and not timed_out:
            return None
        ready = ReadyLoad(load, reads, pending.started, late, error=error, after=pending.after)
        if late:  # a hung disk: recompute; the slots stay taken until the reads end
            detail = f"no answer after {self.timeout:g} s (load_timeout); recomputed"
            remote = {c.key for c in load.chunks if c.remote}
            self._stalled += [(key, reads[key], key in remote) for key in late]
            ready.late_slots = [c.disk_slot for c in load.chunks
                                if c.key in late and c.disk_slot is not None]
            ready.reads = {key: failed_read(detail, IOStatus.TIMED_OUT) if key in late else read
                           for key, read in reads.items()}
        return ready

    def _abandon(self, pending: _Pending) -> ReadyLoad:
        """Still writing back the staging slots' previous chunks, or only now starting its
        reads: reads not started will not be; the staging slots stay taken until the job
        (and any read it did start) is over, as the write-back still reads from them."""
        load = pending.load
        pending.gate.close()
        staged = {c.key for c in load.chunks if c.staged and c.host_slot is not None}
        over = when_all_over(pending.job)
        self._stalled += [(key, over, False) for key in staged]
        detail = f"write-back before the load not over after {self.timeout:g} s (load_timeout)"
        reads = {key: failed_read(detail, IOStatus.TIMED_OUT) for key in staged}
        return ReadyLoad(load, reads, pending.started, late=staged, after=pending.after)

    def released(self) -> list[tuple[bytes, IOResult, bool]]:
        ended, still = [], []
        for key, read, remote in self._stalled:  # one look at each: a read may end meanwhile
            if read.done():
                ended.append((key, read.result(), remote))
            else:
                still.append((key, read, remote))
        self._stalled = still
        return ended

    def jobs(self) -> list[Future]:
        return [pending.job for pending in self._pending]
