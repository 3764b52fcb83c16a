"""An I/O engine for tests: the production engine's threads, with queues a test can hold
(jobs wait until released: a slow or hung drive, without sleeping) or make fail.

Pass ``FakeEngine.factory()`` where kvtier takes an ``io_engine``; ``engines`` then holds
every engine it built, so a test can wait for, hold or break the store's I/O directly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvtier.io.engine import IOEngine


class FakeEngine:
    """An ``IOExecutor``: ``IOEngine`` whose queues can be held or made to fail."""

    def __init__(self, queues: Sequence[str], threads_per_queue: int) -> None:
        self._engine = IOEngine(queues, threads_per_queue)
        self.queues = list(queues)
        self._gates = {name: threading.Event() for name in queues}
        for gate in self._gates.values():
            gate.set()
        self._errors: dict[str, BaseException] = {}
        self._refusing = False
        self.submitted = dict.fromkeys(queues, 0)
        self.drains_timed_out = 0  # waits for every job that ended first (a slow drive)
        self.started = threading.Semaphore(0)  # released as each held job begins to wait
        self._held: dict[str, list[tuple[threading.Event, threading.Event]]] = {
            name: [] for name in queues}  # each held job's (turn, over), in arrival order

    @classmethod
    def factory(cls) -> tuple[Callable[[Sequence[str], int], FakeEngine], list[FakeEngine]]:
        """A factory to pass as ``io_engine``, and the list of the engines it builds."""
        built: list[FakeEngine] = []

        def make(queues: Sequence[str], threads: int) -> FakeEngine:
            built.append(cls(queues, threads))
            return built[-1]

        return make, built

    def hold(self, *queues: str) -> None:
        """Jobs of these queues (all when none is named) wait until ``release``."""
        for name in queues or self.queues:
            self._gates[name].clear()

    def release(self, *queues: str) -> None:
        for name in queues or self.queues:
            self._gates[name].set()
            for turn, _ in self._held[name]:
                turn.set()

    def release_last_first(self, queue_name: str, jobs: int, timeout: float = 10.0) -> None:
        """Once ``jobs`` jobs wait on held queue ``queue_name``, run them one at a time, the
        last to arrive first (a drive answering out of order), then release the queue."""
        for _ in range(jobs):
            assert self.started.acquire(timeout=timeout), f"{jobs} jobs never waited on {queue_name}"
        for turn, over in reversed(self._held[queue_name][:jobs]):
            turn.set()
            assert over.wait(timeout), f"a job of {queue_name} never ended"
        self.release(queue_name)

    def fail(self, error: BaseException, *queues: str) -> None:
        """Jobs of these queues (all when none is named) raise ``error`` instead of running."""
        for name in queues or self.queues:
            self._errors[name] = error

    def heal(self) -> None:
        """Jobs of every queue run again (``fail`` and ``refuse`` undone)."""
        self._errors.clear()
        self._refusing = False

    def refuse(self) -> None:
        """``submit`` raises ``RuntimeError``, as a closed engine's does, until ``heal``."""
        self._refusing = True

    def submit(self, queue_name: str, job: Callable[[], Any]) -> Future:
        if self._refusing:
            raise RuntimeError("kvtier I/O engine is closed (FakeEngine.refuse)")
        self.submitted[queue_name] += 1
        return self._engine.submit(queue_name, lambda: self._run(queue_name, job))

    def _run(self, queue_name: str, job: Callable[[], Any]) -> Any:
        gate = self._gates[queue_name]
        over = threading.Event()
        if not gate.is_set():
            turn = threading.Event()
            self._held[queue_name].append((turn, over))
            self.started.release()
            while not (gate.is_set() or turn.wait(0.01)):
                pass
        try:
            error = self._errors.get(queue_name)
            if error is not None:
                raise error
            return job()
        finally:
            over.set()

    def stop(self) -> None:
        """Stop as kill -9 would, at a job boundary: queued jobs are cancelled, running ones
        end (release held queues first)."""
        self._engine.close(0)
        self._engine.drain()

    def pending(self, queue_name: str | None = None) -> int:
        return self._engine.pending(queue_name)

    def drain(self, timeout: float | None = None) -> bool:
        drained = self._engine.drain(timeout)
        self.drains_timed_out += not drained
        return drained

    def close(self, timeout: float | None = None) -> bool:
        return self._engine.close(timeout)

    @property
    def closed(self) -> bool:
        return self._engine.closed
