"""What a reader of a shared directory does for the writers that are gone: it reclaims their
segments and gives back the seats that name no writer with a segment, judged by its own
clock."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from kvtier.io.safefs import SafeDir
from kvtier.segment.lease import LeaseWatch, beat_every
from kvtier.segment.lock import held_here
from kvtier.segment.names import SEATS_LISTED
from kvtier.segment.seat_orphans import OrphanWatch, give_back_seats, orphan_seats
from kvtier.segment.seats import reclaim_segment
from kvtier.shared.followed import Followed

log = logging.getLogger("kvtier")


class Upkeep:
    """Reclaiming and seat upkeep for one view of namespace ``ns_id`` under ``roots``.

    Contract: ``reclaim(followed)`` deletes the segment of a writer whose lease ``watch``
    saw stand still (``reclaim_segment``: its files, then its seat); True when it is gone
    (``reclaimed`` counts them). It is tried only when ``may_reclaim(followed)``: not while
    a process of this host holds its lock, and once per ``lease_timeout`` after a try that
    failed (said once). The caller closes what it holds open of the segment first: on a
    network filesystem (NFS) a file open on this host is not deleted but renamed
    (``.nfs*``), and the segment, so not empty, and its seat would stay. ``seats_due()`` is
    True once per heartbeat interval; ``free_seats(path)`` then gives back the seats of that
    path that name no writer with a segment and stood unchanged for ``lease_timeout``
    (``OrphanWatch``; ``seats_freed`` counts them). Every time is ``clock``'s."""

    def __init__(self, roots: Sequence[str], ns_id: str, watch: LeaseWatch,
                 clock: Callable[[], float]) -> None:
        self._roots, self._ns_id, self._watch, self._clock = roots, ns_id, watch, clock
        self.reclaimed = 0
        self.seats_freed = 0
        self._reclaim_after: dict[tuple[int, str], float] = {}  # failed: not tried before
        self._seats_at = -math.inf  # when the seats were last looked at
        self._orphans = [OrphanWatch(watch.timeout, clock) for _ in roots]

    def seats_due(self) -> bool:
        now = self._clock()
        if now - self._seats_at < beat_every(self._watch.timeout):
            return False
        self._seats_at = now
        return True

    def free_seats(self, path: int) -> None:
        """Give back the orphan seats of path ``path`` watched long enough: no writer would
        ever free them, and with every seat taken no writer could write."""
        try:
            with SafeDir.open(self._roots[path]) as top, top.subdir(self._ns_id) as ns_dir:
                due = self._orphans[path].due(orphan_seats(ns_dir, None, limit=SEATS_LISTED))
                freed = give_back_seats(ns_dir, due)
        except OSError as exc:
            log.debug("kvtier: cannot look at the seats on %s: %s", self._roots[path], exc)
            return
        if freed:
            log.info("kvtier: gave back seats %s on %s (they named no writer with a segment "
                     "for %g s)", ", ".join(freed), self._roots[path], self._watch.timeout)
            self.seats_freed += len(freed)

    def may_reclaim(self, followed: Followed) -> bool:
        """Whether ``reclaim`` may be tried now: no process of this host holds the segment's
        lock, and no try failed within ``lease_timeout``."""
        key = (followed.path, followed.writer)
        return not held_here(followed.dir) and self._clock() >= self._reclaim_after.get(key, 0)

    def reclaim(self, followed: Followed) -> bool:
        path, writer = followed.path, followed.writer
        try:
            with SafeDir.open(self._roots[path]) as top, top.subdir(self._ns_id) as ns_dir:
                done = reclaim_segment(ns_dir, writer, followed.inode)
        except OSError as exc:
            self._failed(path, writer, str(exc), warn=True)
            return False
        if not done:  # entries kvtier did not write in it, or made again or locked meanwhile
            self._failed(path, writer, "not proven free", warn=False)
        else:
            log.info("kvtier: reclaimed the segment of writer %s on %s (no heartbeat for "
                     "%.0f s)", writer, self._roots[path],
                     self._watch.idle_for(f"{path}:{writer}") or 0.0)
            self.reclaimed += 1
        return done

    def _failed(self, path: int, writer: str, why: str, warn: bool) -> None:
        first = (path, writer) not in self._reclaim_after
        self._reclaim_after[(path, writer)] = self._clock() + self._watch.timeout
        log.log(logging.WARNING if warn and first else logging.DEBUG, "kvtier: could not "
                "reclaim the segment of writer %s on %s: %s (tried again every %g s)", writer,
                self._roots[path], why, self._watch.timeout)

    def forget(self, path: int, writer: str) -> None:
        """Nothing kept of a writer gone."""
        self._reclaim_after.pop((path, writer), None)
