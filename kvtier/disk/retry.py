"""Disk paths out of service, tried again in the background on their own I/O queues."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

from kvtier.disk.tier import DiskTier
from kvtier.io.engine import IOExecutor


class DiskRetries:
    """Starts ``DiskTier.revive`` of each path whose next try is due, one try per path at a
    time, and calls ``on_back(index)`` (with ``lock`` held) for each path that came back.

    ``poll`` does no I/O and may be called on every store; the tries run on the engine's
    queue of that path, so a hung mount holds up only that path's own threads. A try the
    engine refuses (closed) is not started, and is due again at the next ``poll``.
    """

    def __init__(self, disk: DiskTier, engine: IOExecutor, lock: threading.Lock,
                 on_back: Callable[[int], None]) -> None:
        self._disk, self._engine, self._lock, self._on_back = disk, engine, lock, on_back
        self._trying: set[int] = set()

    def poll(self) -> None:
        for index in self._disk.revive_due():
            with self._lock:
                if index in self._trying:
                    continue
                self._trying.add(index)
            try:
                self._engine.submit(self._disk.queues[index], partial(self._try, index))
            except RuntimeError:  # the engine closed (or refused): the try never runs
                with self._lock:
                    self._trying.discard(index)

    def _try(self, index: int) -> None:
        back = False
        try:
            back = self._disk.revive(index)
        finally:
            with self._lock:
                self._trying.discard(index)
                if back:
                    self._on_back(index)
