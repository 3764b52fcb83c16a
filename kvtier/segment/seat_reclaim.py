"""Freeing seats for a writer that has none: at each try of its path, it reclaims the
segments of seat holders it watched stand still for ``lease_timeout``, and gives back the
orphan seats it watched that long. A reader of a shared directory does the same as it
follows the others (``SharedView``); a private cache (``share_refresh`` off) has no reader,
and a writer left without a seat by a gone one (a changed ``instance_id`` or
``share_writers``) would otherwise never write again."""

from __future__ import annotations

import logging

from kvtier.io.safefs import SafeDir
from kvtier.segment.lease import MAX_LEASE_BYTES, LeaseWatch
from kvtier.segment.lock import held_here
from kvtier.segment.names import (
    LEASE_FILE,
    SEATS_DIR,
    SEATS_LISTED,
    WRITER_ID,
    WRITERS_DIR,
    seat_number,
)
from kvtier.segment.seat_files import read_holder
from kvtier.segment.seat_orphans import OrphanWatch, give_back_seats, orphan_seats
from kvtier.segment.seats import reclaim_segment

log = logging.getLogger("kvtier")


class SeatReclaimer:
    """Contract: ``free_seats(root, namespace_id, own)`` looks at the seats of that namespace
    under ``root`` once and returns how many it freed: the segment of each holder other than
    ``own`` whose lease this reclaimer watched stand still (``LeaseWatch``: by its own
    clock, from its first look) for ``lease_timeout`` and that no process of this host holds
    (``held_here``) is reclaimed (``reclaim_segment``: its files, then its seat), and the
    orphan seats it watched unchanged that long are given back (``OrphanWatch``). Nothing is
    freed at the first look. A path that cannot be read frees nothing (its open says why)."""

    def __init__(self, lease_timeout: float) -> None:
        self._leases = LeaseWatch(lease_timeout)
        self._orphans: dict[tuple[str, str], OrphanWatch] = {}

    def free_seats(self, root: str, namespace_id: str, own: str) -> int:
        try:
            with SafeDir.open(root) as top, top.subdir(namespace_id) as ns_dir:
                if ns_dir.lstat(SEATS_DIR) is None:
                    return 0
                watch = self._orphans.setdefault((root, namespace_id),
                                                 OrphanWatch(self._leases.timeout))
                freed = len(give_back_seats(ns_dir, watch.due(
                    orphan_seats(ns_dir, None, limit=SEATS_LISTED))))
                with ns_dir.subdir(SEATS_DIR) as seats:
                    holders = {_holder(seats, name) for name in seats.scan(SEATS_LISTED)
                               if seat_number(name) is not None}
                for writer in sorted(h for h in holders if h and h != own and WRITER_ID.fullmatch(h)):
                    freed += self._reclaim_if_gone(root, ns_dir, writer)
        except OSError as exc:
            log.debug("kvtier: cannot look at the seats on %s: %s", root, exc)
            return 0
        return freed

    def _reclaim_if_gone(self, root: str, ns_dir: SafeDir, writer: str) -> int:
        """1 when ``writer``'s segment was reclaimed (gone that long), else 0."""
        name = f"{root}:{ns_dir.path}:{writer}"
        try:
            with ns_dir.subdir(WRITERS_DIR) as writers, writers.subdir(writer) as segment:
                try:
                    lease = segment.read_file(LEASE_FILE, MAX_LEASE_BYTES)
                except OSError:
                    lease = None
                if self._leases.observe(name, lease) or held_here(segment):
                    return 0
                inode = segment.inode()
            if not reclaim_segment(ns_dir, writer, inode):
                return 0
        except OSError:  # no segment (an orphan seat: above), or not one kvtier can touch
            return 0
        log.info("kvtier: reclaimed the segment of writer %s on %s (no heartbeat for %.0f s): "
                 "its seat is free", writer, root, self._leases.idle_for(name) or 0.0)
        self._leases.forget(name)
        return 1


def _holder(seats: SafeDir, name: str) -> str | None:
    """``read_holder``; None when the seat cannot be read now (it is looked at again at the
    next try), so that one seat unreadable for a moment keeps no other from being freed."""
    try:
        return read_holder(seats, name)
    except OSError:
        return None
