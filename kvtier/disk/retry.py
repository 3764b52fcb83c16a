"""Disk paths out of service, tried again in the background on their own I/O queues."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial

from kvtier.disk.recovery import RecoveredSlot, RecoveryReport
from kvtier.disk.tier import DiskTier
from kvtier.io.bounded_jobs import path_job_wait
from kvtier.io.engine import IOExecutor
from kvtier.io.guarded import start_thread

log = logging.getLogger("kvtier.disk.tier")  # the disk tier's messages

SHARE_PAUSE_S = 0.001  # between two shares of an adoption: a waiting caller takes the lock
# a path back: its index and what it holds; returns None, or a call that takes a share of
# it back with the lock taken (not held by the caller) and says whether some is left
OnBack = Callable[[int, list[RecoveredSlot]], "Callable[[], bool] | None"]


class DiskRetries:
    """Starts ``DiskTier.revive`` of each path whose next try is due, one try per path at a
    time, and calls ``on_back(index, found)`` (with ``lock`` held) for each path that came
    back.

    ``found``: a path out of service since the start (never read back by this tier: its
    file system hung, or stopped answering during its read-back at start; its segment's
    lock or every seat was held) is read back as at start, from its index file or a scan
    of its slot headers (``threads`` at a time), before it is said to be back; ``found``
    is what it holds, as ``DiskTier.recover`` reports it, newest first. Where
    ``on_back`` returns a call, the thread that said the path back (the read-back's, or
    the try's on the path's queue) makes it, without the lock, until it returns False (the
    owner adopts ``found`` and puts the path's slots back in service a share a lock hold)
    or the engine closes. A path that was in service before comes back empty (``found``
    is empty): what it held while it failed (a sync that failed loses writes no one can
    name) is not vouched for. A path that fails again while it is read back is not said
    to be back.

    ``poll`` does no I/O and may be called on every store; the tries run on the engine's
    queue of that path, so a hung mount holds up only that path's own threads. A try the
    engine refuses (closed) is not started, and is due again at the next ``poll``. A
    read-back runs on a daemon thread of its own, never on the engine's queues (a flush's
    drain, a close, do not wait for it); one not over within ``path_job_wait`` of the
    tier's ``load_timeout`` (a mount that stopped answering) is given up at a ``poll``: the
    path is taken out again, to be tried again (what the read-back finds later is dropped).
    """

    def __init__(self, disk: DiskTier, engine: IOExecutor, lock: threading.Lock,
                 on_back: OnBack, threads: int = 8) -> None:
        self._disk, self._engine, self._lock, self._on_back = disk, engine, lock, on_back
        self._threads, self._wait = threads, path_job_wait(disk.paths.answer_timeout)
        self._trying: set[int] = set()
        self._reading: dict[int, tuple[float, object]] = {}  # path -> (began, its read-back)

    def poll(self) -> None:
        self._give_up_late_reads()
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
        """On the path's queue: reopen it; said back at once unless it must be read back."""
        back, token, more = False, object(), None
        try:
            back = self._disk.revive(index)
        finally:
            with self._lock:
                reading = back and not self._disk.paths.states[index].read_back
                if reading:
                    self._reading[index] = (time.monotonic(), token)
                else:
                    self._trying.discard(index)
                    if back:
                        more = self._on_back(index, [])
        self._shares(more)
        if reading:
            thread = threading.Thread(target=self._read_back, args=(index, token), daemon=True,
                                      name="kvtier-read-back")
            if not start_thread(thread):
                self._read_back(index, token)  # no thread to be had: here, as at start

    def _read_back(self, index: int, token: object) -> None:
        """What path ``index`` holds, then said back (unless given up on meanwhile)."""
        path = self._disk.paths.states[index]
        report: RecoveryReport | None = None
        more = None
        try:
            report = self._disk.recover(self._threads, path=index)
            report.slots.sort(key=lambda r: r.header.generation, reverse=True)  # off the lock
        finally:
            with self._lock:
                if self._reading.get(index, (0.0, None))[1] is token:
                    del self._reading[index]
                    self._trying.discard(index)
                    if report is not None and path.dir is not None and not self._engine.closed:
                        log.info("kvtier disk path %s, out of service since the start: %d chunks "
                                 "found on it (%d slots torn)", path.root, len(report.slots),
                                 report.torn)
                        more = self._on_back(index, report.slots)
        self._shares(more)

    def _shares(self, more: Callable[[], bool] | None) -> None:
        """The rest of a path's way back, a share a hold of the lock (``OnBack``)."""
        while more is not None and not self._engine.closed and more():
            time.sleep(SHARE_PAUSE_S)  # the lock to a caller waiting (it is no fair lock)

    def _give_up_late_reads(self) -> None:
        if not self._reading or self._wait is None:
            return
        now, paths = time.monotonic(), self._disk.paths
        with self._lock:
            late = [i for i, (began, _) in self._reading.items() if now - began > self._wait]
            for index in late:
                del self._reading[index]
                self._trying.discard(index)
        for index in late:
            path = paths.states[index]
            paths.take_down(path, f"not read back within {self._wait:g} s (a mount that stopped "
                            "answering?): read back when it is tried again", path.dir)
