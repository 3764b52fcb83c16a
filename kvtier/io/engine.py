"""The I/O engine: blocking I/O jobs on worker threads, one queue of threads per disk path.

Each disk path gets its own queue with its own threads, so a slow or failing drive does not
hold up the others. Jobs are callables doing positional, vectored reads and writes
(``os.preadv``/``os.pwritev`` release the GIL), so threads overlap real I/O. aiofiles and io_uring
(the PyPI binding), measured on the same reads, were never consistently faster, and io_uring
falls behind beside a busy Python thread (docs/benchmarks.md), so neither is used.

Owners take the engine as an :class:`IOExecutor` built by an :data:`EngineFactory`, so tests
pass an engine of their own (``tests/helpers/fake_io.py``) to hold, fail or hang jobs without sleeping.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from kvtier.io.guarded import start_threads, submit_guarded
from kvtier.io.in_flight import InFlight

CLOSE_TIMEOUT_S = 30.0  # how long closing waits for queued and running jobs


class IOExecutor(Protocol):
    """Named queues running blocking I/O jobs, like an executor with one pool per queue.

    Contract:

    - ``submit(queue, job)`` queues ``job()`` and returns its ``Future`` at once; it never
      blocks on I/O. Jobs of one queue run on that queue's threads, in parallel; a job's
      exception is in its future. Once closed, ``submit`` raises ``RuntimeError``. A
      ``submit`` that raises never runs its job.
    - ``pending(queue=None)`` counts jobs submitted and not finished (for back-pressure), of
      one queue or of all. A job is finished once it is over (run, or cancelled through
      ``guarded.cancel``) and the callbacks of its future have run: they give back what
      the job held, and a drain followed by a look for room must find it given back. So
      a callback never drains the engine its job ran on.
    - ``drain(timeout)`` waits until every job pending at the call is finished; True if
      none of them is left.
    - ``closed`` is True once ``close`` has drained (or given up) and ``submit`` refuses.
    - ``close(timeout)`` drains for at most ``timeout``, then stops. Jobs still running then
      (an I/O call blocked on a hung drive) cannot be stopped: the jobs not started yet are
      cancelled, ``close`` returns False at once, and the memory and files the running jobs
      use must stay valid until they end (the caller leaves them to the process's exit).
    """

    def submit(self, queue_name: str, job: Callable[[], Any]) -> Future: ...

    def pending(self, queue_name: str | None = None) -> int: ...

    def drain(self, timeout: float | None = None) -> bool: ...

    def close(self, timeout: float | None = None) -> bool: ...

    @property
    def closed(self) -> bool: ...


# builds an engine for these queues with this many threads each
EngineFactory = Callable[[Sequence[str], int], IOExecutor]


class IOEngine:
    """The :class:`IOExecutor` of production: a thread pool per queue, its threads all
    started with the engine (a thread that cannot be started fails the engine's making,
    not a later ``submit``).

    A job runs only if its own future is still pending when a thread takes it: a ``submit``
    that raised never runs its job later (the pool may have queued it before failing), so
    its caller may give back what the job would have used. The process's own exit still
    waits for threads blocked in I/O on a hung drive, as the kernel waits for the I/O they
    are blocked in.
    """

    def __init__(self, queues: Sequence[str], threads_per_queue: int) -> None:
        if threads_per_queue < 1:
            raise ValueError(f"threads_per_queue must be >= 1, got {threads_per_queue}")
        self._pools = {
            name: ThreadPoolExecutor(threads_per_queue, thread_name_prefix=f"kvtier-io-{i}")
            for i, name in enumerate(queues)
        }
        self._jobs = InFlight()
        self._lock = threading.Lock()
        self._closed = False
        try:
            for pool in self._pools.values():
                start_threads(pool, threads_per_queue)
        except BaseException:
            self.close(0)
            raise

    def submit(self, queue_name: str, job: Callable[[], Any]) -> Future:
        pool = self._pools[queue_name]  # (an unknown queue counts no job)
        # never hold our lock around the pool's submit: closing holds the pool's lock while
        # it cancels queued jobs, and a job may submit another (a write group)
        with self._lock:
            if self._closed:
                raise RuntimeError("kvtier I/O engine is closed")
            future: Future = Future()
            over = self._jobs.add(future, queue_name)
        return submit_guarded(pool, job, future=future, over=over)  # raises once shut down

    def pending(self, queue_name: str | None = None) -> int:
        return self._jobs.count(queue_name)

    def drain(self, timeout: float | None = None) -> bool:
        return self._jobs.drain(timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = None) -> bool:
        drained = self.drain(timeout)
        with self._lock:
            self._closed = True  # from now on submit refuses, before the pools shut down
        for pool in self._pools.values():
            pool.shutdown(wait=drained, cancel_futures=not drained)
        return drained
