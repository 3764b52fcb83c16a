"""Disk paths out of service, tried again in the background on their own I/O queues."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial

from kvtier.disk.recovery import RecoveredSlot
from kvtier.disk.tier import DiskTier
from kvtier.io.engine import IOExecutor

log = logging.getLogger("kvtier.disk.tier")  # the disk tier's messages

OnBack = Callable[[int, list[RecoveredSlot]], None]


class DiskRetries:
    """Starts ``DiskTier.revive`` of each path whose next try is due, one try per path at a
    time, and calls ``on_back(index, found)`` (with ``lock`` held) for each path that came
    back.

    ``found``: a path out of service since the start (never opened by this tier: its file
    system hung, its segment's lock or every seat was held) is read back as at start, from
    its index file or a scan of its slot headers (``threads`` at a time), before it is said
    to be back; ``found`` is what it holds, as ``DiskTier.recover`` reports it. A path that
    was in service before comes back empty (``found`` is empty): what it held while it
    failed (a sync that failed loses writes no one can name) is not vouched for. A path
    that fails again while it is read back is not said to be back.

    ``poll`` does no I/O and may be called on every store; the tries run on the engine's
    queue of that path, so a hung mount holds up only that path's own threads. A try the
    engine refuses (closed) is not started, and is due again at the next ``poll``.
    """

    def __init__(self, disk: DiskTier, engine: IOExecutor, lock: threading.Lock,
                 on_back: OnBack, threads: int = 8) -> None:
        self._disk, self._engine, self._lock, self._on_back = disk, engine, lock, on_back
        self._threads = threads
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
        found: list[RecoveredSlot] | None = None
        try:
            found = self._back(index)
        finally:
            with self._lock:
                self._trying.discard(index)
                if found is not None:
                    self._on_back(index, found)

    def _back(self, index: int) -> list[RecoveredSlot] | None:
        """What path ``index`` holds once it is back in service (see the class); None
        while it is out."""
        path = self._disk.paths.states[index]
        served = path.served
        if not self._disk.revive(index):
            return None
        if served:
            return []
        report = self._disk.recover(self._threads, path=index)
        if path.dir is None:
            return None
        log.info("kvtier disk path %s, out of service since the start: %d chunks found on "
                 "it (%d slots torn)", path.root, len(report.slots), report.torn)
        return report.slots
