"""The I/O engine: blocking I/O jobs on worker threads, behind submit/poll/drain.

Each disk path gets its own queue with its own threads, so a slow or failing drive does not
hold up the others. Jobs are callables doing positional, vectored reads and writes
(``os.preadv``/``os.pwritev`` release the GIL), so threads overlap real I/O. aiofiles and io_uring
(the PyPI binding), measured on the same reads, were never consistently faster, and io_uring
falls behind beside a busy Python thread (docs/benchmarks.md), so neither is used.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

CLOSE_TIMEOUT_S = 30.0  # how long closing waits for queued and running jobs


@dataclass(frozen=True)
class Completion:
    """A finished job that was submitted with a tag: its value, or the exception it raised."""

    tag: Hashable
    value: Any = None
    error: BaseException | None = None


class IOEngine:
    """Named queues of worker threads running blocking I/O jobs.

    Contract:

    - ``submit(queue, job, tag=None)`` queues ``job()`` and returns its ``Future`` at once;
      it never blocks on I/O. Jobs of one queue run on that queue's threads, in parallel.
    - ``poll()`` returns, without blocking, the :class:`Completion` of every tagged job that
      finished since the last ``poll``; untagged jobs are followed through their futures.
    - ``pending(queue)`` counts jobs submitted and not finished (for back-pressure).
    - ``drain(timeout)`` waits until no job is pending.
    - ``close(timeout)`` drains for at most ``timeout``, then stops the threads. Jobs still
      running then (an I/O call blocked on a hung drive) cannot be stopped: the jobs not
      started yet are cancelled, ``close`` returns False at once, and the memory and files
      the running jobs use must stay valid until they end (the caller leaves them to the
      process's exit). The process's own exit still waits for those threads, as the kernel
      waits for the I/O they are blocked in.
    """

    def __init__(self, queues: Sequence[str], threads_per_queue: int) -> None:
        if threads_per_queue < 1:
            raise ValueError(f"threads_per_queue must be >= 1, got {threads_per_queue}")
        self._pools = {
            name: ThreadPoolExecutor(threads_per_queue, thread_name_prefix=f"kvtier-io-{i}")
            for i, name in enumerate(queues)
        }
        self._pending = dict.fromkeys(self._pools, 0)
        self._inflight: set[Future] = set()
        self._lock = threading.Lock()
        self._completions: queue.SimpleQueue[Completion] = queue.SimpleQueue()

    def submit(self, queue_name: str, job: Callable[[], Any], tag: Hashable | None = None) -> Future:
        with self._lock:
            future = self._pools[queue_name].submit(job)  # raises once closed
            self._pending[queue_name] += 1
            self._inflight.add(future)
        future.add_done_callback(lambda f: self._finished(queue_name, f, tag))
        return future

    def _finished(self, queue_name: str, future: Future, tag: Hashable | None) -> None:
        with self._lock:
            self._pending[queue_name] -= 1
            self._inflight.discard(future)
        if tag is not None:
            error = CancelledError() if future.cancelled() else future.exception()
            self._completions.put(Completion(tag, None if error else future.result(), error))

    def poll(self) -> list[Completion]:
        done = []
        while True:
            try:
                done.append(self._completions.get_nowait())
            except queue.Empty:
                return done

    def pending(self, queue_name: str | None = None) -> int:
        with self._lock:
            return sum(self._pending.values()) if queue_name is None else self._pending[queue_name]

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every job submitted so far; True if none is left."""
        with self._lock:
            futures = set(self._inflight)
        _, not_done = wait_futures(futures, timeout=timeout)
        return not not_done

    def close(self, timeout: float | None = None) -> bool:
        """Drain for at most ``timeout`` seconds, then stop; True when every job ended."""
        drained = self.drain(timeout)
        for pool in self._pools.values():
            pool.shutdown(wait=drained, cancel_futures=not drained)
        return drained
