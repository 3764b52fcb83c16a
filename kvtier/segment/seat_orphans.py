"""Orphan seats: a seat that names no writer with a segment (empty or not one kvtier wrote:
a crash of a version that wrote seats in place; or a writer that crashed before it made its
segment), and the temporary files ``write_seat`` left, judged by their file times
(``orphan_seats``) or by watching them (``OrphanWatch``), then given back
(``give_back_seats``) once they stood unchanged long enough.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

from kvtier.io.safefs import SafeDir
from kvtier.segment.names import SEATS_DIR, SEATS_LISTED, TEMP_NAME, WRITER_ID, WRITERS_DIR, seat_number
from kvtier.segment.seat_files import linked_temps, mine, read_holder


def orphan_seats(ns_dir: SafeDir, older_than_s: float | None, now_ns: int | None = None,
                 limit: int | None = None) -> list[tuple[str, os.stat_result]]:
    """The seats of the namespace open as ``ns_dir`` that name no writer with a segment
    (empty, unreadable, or naming a writer whose ``writers/<id>`` does not exist), the
    temporary files of ``write_seat`` and the ``linked_temps``, each with its ``lstat``,
    last modified ``older_than_s`` seconds or more ago by this machine's clock (a seat is
    whole before it has its name, and its writer makes its segment just after: neither is
    that old), or whatever their times with ``None`` (for a caller that judges by watching:
    ``OrphanWatch``). Changes nothing, and lists only what is provably kvtier's: regular
    files of this user with one link, or a linked temporary file (a seat that still has its
    temporary file's link is judged once that is gone). With ``limit`` (an engine's look,
    on a thread whose interpreter lock the scheduler needs) only the first ``limit`` entries
    of ``seats/`` in its own order are looked at, and only those named as seats or their
    temporary files are looked at further: junk there costs no more than that. Without
    (``kvtier gc``) all of ``seats/`` is, up to ``SEATS_LISTED`` entries: past them,
    ``UnsafeEntry`` (E2BIG) naming the directory and the bound, and nothing is judged."""
    if ns_dir.lstat(SEATS_DIR) is None:
        return []
    cutoff = math.inf if older_than_s is None else (
        (time.time_ns() if now_ns is None else now_ns) - older_than_s * 1e9)  # never overflows
    found = []
    with ns_dir.subdir(SEATS_DIR) as seats:
        names = [name for name in (seats.listed(SEATS_LISTED) if limit is None else seats.scan(limit))
                 if seat_number(name) is not None or TEMP_NAME.fullmatch(name)]
        linked = linked_temps(seats, names)
        for name in names:
            info = seats.lstat(name)
            if not mine(info) or info.st_mtime_ns > cutoff:
                continue
            if name in linked or (info.st_nlink == 1 and (TEMP_NAME.fullmatch(name) or (
                    seat_number(name) is not None and not _has_segment(ns_dir, seats, name)))):
                found.append((name, info))
    return found


def _has_segment(ns_dir: SafeDir, seats: SafeDir, name: str) -> bool:
    """True when seat ``name`` of ``seats`` holds a writer id whose ``writers/<id>`` entry
    exists (or when that cannot be told, the seat or the entry unreadable for a moment: the
    cautious answer)."""
    try:
        writer = read_holder(seats, name)
    except OSError:
        return True
    if not writer or not WRITER_ID.fullmatch(writer):
        return False
    try:
        if ns_dir.lstat(WRITERS_DIR) is None:
            return False
        with ns_dir.subdir(WRITERS_DIR) as writers:
            return writers.lstat(writer) is not None
    except OSError:
        return True


class OrphanWatch:
    """A reader's judgement of orphan seats by its own clock, as leases are judged
    (``LeaseWatch``): file times written by another machine's clock, or a server's, say
    nothing here.

    Contract: ``due(found)`` takes the orphans found just now (``orphan_seats(ns_dir,
    None)``) and returns those seen at every look, unchanged (inode, modification time,
    size, links), for ``timeout`` seconds or more of this watch's monotonic clock. A seat
    missing from a look, or changed, starts over."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout, self._clock = timeout, clock
        self._seen: dict[str, tuple[tuple[int, int, int, int], float]] = {}

    def due(self, found: list[tuple[str, os.stat_result]]) -> list[tuple[str, os.stat_result]]:
        now = self._clock()
        seen = {}
        for name, info in found:
            mark = (info.st_ino, info.st_mtime_ns, info.st_size, info.st_nlink)
            before = self._seen.get(name)
            seen[name] = (mark, before[1] if before is not None and before[0] == mark else now)
        self._seen = seen
        return [(name, info) for name, info in found if now - seen[name][1] >= self.timeout]


def free_orphan_seats(ns_dir: SafeDir, older_than_s: float, dry_run: bool = False) -> list[str]:
    """Give back what ``orphan_seats`` finds (each only if it is still the file that was
    judged), or with ``dry_run`` only list it; return the names."""
    orphans = orphan_seats(ns_dir, older_than_s)
    if dry_run or not orphans:
        return [name for name, _ in orphans]
    return give_back_seats(ns_dir, orphans)


def give_back_seats(ns_dir: SafeDir, orphans: list[tuple[str, os.stat_result]]) -> list[str]:
    """Remove each of ``orphans`` (judged by ``orphan_seats``) that is still the file that
    was judged; return the names removed."""
    if not orphans:
        return []
    freed = []
    with ns_dir.subdir(SEATS_DIR) as seats:
        # a temporary file whose seat lies past these is not known as linked: left alone
        linked = linked_temps(seats, seats.scan(SEATS_LISTED))
        for name, info in orphans:
            now = seats.lstat(name)
            if now is None or (now.st_ino, now.st_mtime_ns) != (info.st_ino, info.st_mtime_ns):
                continue  # freed and taken again since
            try:
                removed = seats.remove_file(name, links=2 if name in linked else 1)
            except OSError:
                continue  # not a regular file of ours with one link any more: left alone
            if removed:
                freed.append(name)
    return freed
