"""A writer's heartbeats: every lease it holds (one per disk path) rewritten every few
seconds, each path's beats on a long-lived thread of its own, so that a path whose
filesystem hangs holds back no other path's lease."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable

from kvtier.segment.lease import CLOSE_WAIT_S, Lease, LeaseLost

log = logging.getLogger("kvtier")
HUNG_TURNS = 3  # turns a beat may stay under way before its path is told (half a lease_timeout)


class LeaseHung(LeaseLost):
    """A beat of this writer's lease has not returned for ``HUNG_TURNS`` turns (a network
    filesystem whose server is gone, a sync that does not end): its lease stands still, and
    the other engines will take this writer for gone once their ``lease_timeout`` passed."""

    def __init__(self, path: str, seconds: float) -> None:
        super().__init__(errno.ETIMEDOUT, f"the lease heartbeat of {path} has hung for "
                         f"{seconds:g} s (a hung filesystem?): its lease stands still, and the "
                         "other engines would take this writer for gone")


class LeaseFailing(LeaseLost):
    """The beats of this writer's lease have failed ``HUNG_TURNS`` times in a row (a full
    filesystem, the lease file swapped for a directory): its lease stands still as a hung
    one's does."""

    def __init__(self, path: str, failed: int, error: OSError) -> None:
        super().__init__(error.errno or errno.EIO, f"the lease heartbeat of {path} failed "
                         f"{failed} times in a row ({error.strerror or error}): its lease stands "
                         "still, and the other engines would take this writer for gone")


class _Beater:
    """One lease's beat thread (``kvtier-beat``), long-lived: it beats the lease once each
    time ``ask`` is called, and ends once ``stop`` was called and its beat under way, if
    any, returned."""

    def __init__(self, lease: Lease, beat: Callable[[Lease], None]) -> None:
        self.lease, self._beat = lease, beat
        self.turns = 0  # turns the beat asked for last has been under way (the keeper's)
        self._changed = threading.Condition()
        self._asked = self._busy = self._stopped = self._ended = False
        self.thread = threading.Thread(target=self._run, name="kvtier-beat", daemon=True)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._asked or self._stopped)
                if self._stopped:  # a beat asked for and not begun is not made
                    self._asked = self._busy = False
                    self._ended = True
                    return
                self._asked = False
            try:
                self._beat(self.lease)
            finally:
                with self._changed:
                    self._busy = False

    def ask(self) -> bool:
        """Ask for a beat; False, and nothing asked, while the last one asked is under way."""
        with self._changed:
            if self._busy:
                return False
            self._asked = self._busy = True
            self._changed.notify()
        self.turns = 0
        return True

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()

    def resume(self) -> bool:
        """Undo ``stop``; False when the thread has ended (or never started)."""
        with self._changed:
            self._stopped = False
            return not self._ended and self.thread.is_alive()


class LeaseKeeper:
    """A daemon thread that, every ``every`` seconds until ``close``, has every lease
    ``leases()`` returns beaten, each on a long-lived thread of its own (``_Beater``), kept
    while the lease is listed: a path whose filesystem hangs holds back no other path's
    beats, and no thread is started per beat.

    A lease whose beat is still under way at its next turn is not beaten again (one thread at
    most waits on a hung path). Its lease file stands still meanwhile, as a gone writer's
    does: after their ``lease_timeout`` the other engines take this writer for gone on that
    path, and may reclaim that segment. So once a beat has been under way for ``HUNG_TURNS``
    turns in a row, ``on_conflict(lease, LeaseHung)`` is called, once for that beat (its
    path goes out of service, ``DiskPaths``: this writer stops writing a segment the others
    are about to take for a dead writer's); once it returns, the lease is beaten again at
    its next turn. A lease no longer listed has its thread end (once its beat under way
    returned); one listed anew (a path back in service) gets a thread. A beat that finds
    another writer's lease, or its seat gone, calls ``on_conflict(lease, error)``; one that
    fails otherwise (the segment was taken away, the path is down, the filesystem is full)
    is logged at debug level (the path's own health checks report it), and once beats have
    failed ``HUNG_TURNS`` times in a row ``on_conflict(lease, LeaseFailing)`` is called, as
    for a hung beat: a lease that stands still while its writer writes on would have the
    others reclaim a live segment. ``close`` stops the turns, then waits
    for the beats under way, ``CLOSE_WAIT_S`` at most in all (a hung one ends on its own;
    its lease is closed after it, ``Lease.close``)."""

    def __init__(self, leases: Callable[[], list[Lease]], every: float,
                 on_conflict: Callable[[Lease, LeaseLost], None] = lambda lease, e: None,
                 ) -> None:
        self._leases, self._every, self._on_conflict = leases, every, on_conflict
        self._stop = threading.Event()
        self._beaters: dict[Lease, _Beater] = {}  # threads alive (the keeper's thread only)
        self._failed: dict[Lease, int] = {}  # beats failed in a row (each lease's own thread)
        self._thread = threading.Thread(target=self._run, name="kvtier-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._turn()

    def _turn(self) -> None:
        """Ask each listed lease's thread for a beat, or count a turn against a beat still
        under way; stop the threads of leases no longer listed."""
        listed = self._leases()
        self._beaters = {lease: b for lease, b in self._beaters.items() if b.thread.is_alive()}
        for lease in listed:
            beater = self._beaters.get(lease)
            if beater is None or not beater.resume():
                beater = self._start(lease)
            if beater is None or beater.ask():
                continue
            beater.turns += 1
            if beater.turns == HUNG_TURNS:
                self._on_conflict(lease, LeaseHung(lease.path, HUNG_TURNS * self._every))
        for lease in self._beaters.keys() - set(listed):
            self._beaters[lease].stop()
            self._failed.pop(lease, None)

    def _start(self, lease: Lease) -> _Beater | None:
        beater = _Beater(lease, self._beat)
        try:
            beater.thread.start()
        except RuntimeError as exc:  # no thread to be had now: tried again next turn
            log.debug("kvtier: lease heartbeat not started: %s", exc)
            return None
        self._beaters[lease] = beater
        return beater

    def _beat(self, lease: Lease) -> None:
        """One beat (on the lease's own thread: its count of failures in a row is its own)."""
        try:
            lease.beat()
        except LeaseLost as exc:
            self._on_conflict(lease, exc)
        except OSError as exc:
            failed = self._failed[lease] = self._failed.get(lease, 0) + 1
            log.debug("kvtier: lease heartbeat failed: %s", exc)
            if failed == HUNG_TURNS:
                self._on_conflict(lease, LeaseFailing(lease.path, failed, exc))
        else:
            self._failed.pop(lease, None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for beater in self._beaters.values():
            beater.stop()
        deadline = time.monotonic() + CLOSE_WAIT_S  # beats under way: waited for, bounded
        for beater in self._beaters.values():
            beater.thread.join(max(0.0, deadline - time.monotonic()))
