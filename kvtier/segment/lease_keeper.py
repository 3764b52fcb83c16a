"""A writer's heartbeats: every lease it holds (one per disk path) rewritten every few
seconds, each path's beat on a thread of its own, so that a path whose filesystem hangs
holds back no other path's lease."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass
class _Beat:
    """A beat under way on a thread of its own, and the turns it has been so since."""

    thread: threading.Thread
    turns: int = 0


class LeaseKeeper:
    """A daemon thread that, every ``every`` seconds until ``close``, starts a beat of every
    lease ``leases()`` returns, each on a thread of its own (``kvtier-beat``): a path whose
    filesystem hangs holds back no other path's beats.

    A lease whose beat is still under way at its next turn is not beaten again (one thread at
    most waits on a hung path). Its lease file stands still meanwhile, as a gone writer's
    does: after their ``lease_timeout`` the other engines take this writer for gone on that
    path, and may reclaim that segment. So once a beat has been under way for ``HUNG_TURNS``
    turns in a row, ``on_conflict(lease, LeaseHung)`` is called, once for that beat (its
    path goes out of service, ``DiskPaths``: this writer stops writing a segment the others
    are about to take for a dead writer's); once it returns, the lease is beaten again at
    its next turn. A beat that finds another writer's lease, or its seat gone, calls
    ``on_conflict(lease, error)``; one that fails otherwise (the segment was taken away,
    the path is down) is logged at debug level: the path's own health checks report it.
    ``close`` stops the turns, then waits for the beats under way, ``CLOSE_WAIT_S`` at most
    in all (a hung one ends on its own; its lease is closed after it, ``Lease.close``)."""

    def __init__(self, leases: Callable[[], list[Lease]], every: float,
                 on_conflict: Callable[[Lease, LeaseLost], None] = lambda lease, e: None,
                 ) -> None:
        self._leases, self._every, self._on_conflict = leases, every, on_conflict
        self._stop = threading.Event()
        self._beats: dict[Lease, _Beat] = {}  # beats under way (the keeper's thread only)
        self._thread = threading.Thread(target=self._run, name="kvtier-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._turn()

    def _turn(self) -> None:
        """Start a beat of each lease whose last one returned; count a turn against the
        others."""
        self._beats = {lease: b for lease, b in self._beats.items() if b.thread.is_alive()}
        for lease in self._leases():
            under_way = self._beats.get(lease)
            if under_way is not None:
                under_way.turns += 1
                if under_way.turns == HUNG_TURNS:
                    self._on_conflict(lease, LeaseHung(lease.path, HUNG_TURNS * self._every))
                continue
            thread = threading.Thread(target=self._beat, args=(lease,), name="kvtier-beat",
                                      daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had now: tried again next turn
                log.debug("kvtier: lease heartbeat not started: %s", exc)
                continue
            self._beats[lease] = _Beat(thread)

    def _beat(self, lease: Lease) -> None:
        try:
            lease.beat()
        except LeaseLost as exc:
            self._on_conflict(lease, exc)
        except OSError as exc:
            log.debug("kvtier: lease heartbeat failed: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + CLOSE_WAIT_S  # beats under way: waited for, bounded
        for beat in self._beats.values():
            beat.thread.join(max(0.0, deadline - time.monotonic()))
