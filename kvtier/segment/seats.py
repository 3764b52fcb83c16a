"""Seats: how ``disk_capacity`` stays a hard bound for a namespace's directory shared by many
writers, and how the segment of a writer that is gone is handed back.

A writer holds a segment only while it holds one of ``share_writers`` seats: a file
``seats/seat-NNNN`` holding its id, so at most ``share_writers`` segments exist and each
holds at most ``disk_capacity / share_writers``. A seat is made crash-safely
(``seat_files.write_seat``): the id is written and synced under a temporary name, then hard-linked to
the seat's name, which is atomic and never replaces a seat (on local and network
filesystems alike), so a seat is whole or absent. A writer that restarts finds its own seat
again. A seat is given back only with its segment, when the segment is reclaimed: never
while the segment's bytes are on disk. A seat that names no writer with a segment is an
orphan, given back once it stood unchanged long enough (``kvtier.segment.seat_orphans``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from kvtier.io.safefs import CacheDirError, SafeDir
from kvtier.segment.names import (
    INDEX_FILE,
    LEASE_FILE,
    LOCK_FILE,
    LOG_FILE,
    SEAT_FILE,
    SEATS_DIR,
    SEATS_LISTED,
    SEGMENT_LISTED,
    TEMP_NAME,
    WRITERS_DIR,
    seat_number,
    slot_number,
)
from kvtier.segment.seat_files import linked_temps, read_holder, write_seat

_SEGMENT_FILES = (LEASE_FILE, LOG_FILE, INDEX_FILE, LOCK_FILE)  # the lock goes last


def claim_seat(ns_dir: SafeDir, writer: str, limit: int) -> int:
    """The number of ``writer``'s seat in the namespace open as ``ns_dir``: the one it holds
    already among the first ``limit``, else the first free one, taken (``write_seat``); a
    seat of its own past ``limit`` (from a run with a larger ``share_writers``) is given back
    once it holds one within. ``CacheDirError`` (EDQUOT) when the seats held by others,
    whatever their number, are ``limit`` or more: a seat past ``limit`` is that of a writer
    that ran with a larger ``share_writers``, whose segment still takes its share of
    ``disk_capacity`` until it is reclaimed (one of ``writer``'s own does not count: it
    goes as ``writer`` takes one within); or when writers claiming at the same moment took
    the free ones (``_one_too_many``). ``CacheDirError`` (EBUSY) when, left without one,
    ``writer`` finds a seat under its own id that it did not hold as it began: another
    process claimed one under that id at the same moment (two processes of this host trying
    one default id before either made its segment), so the id is that process's and the
    caller tries its next. Seated, ``writer`` keeps one seat (``_keep_one``)."""
    with ns_dir.subdir(SEATS_DIR, create=True) as seats:
        held = _held_seats(seats)
        own = {name for name, holder in held.items() if holder == writer}
        seat = _seat_within(seats, held, own, writer, limit) if len(held) - len(own) < limit \
            else None
        if seat is not None:
            return _keep_one(seats, writer, seat, limit)
        now = _held_seats(seats)
    if any(holder == writer and name not in own for name, holder in now.items()):
        raise _taken_under_own_id(ns_dir.path, writer)
    raise _no_seat(ns_dir.path, [holder for holder in now.values() if holder != writer], limit)


def _seat_within(seats: SafeDir, held: dict[str, str | None], own: set[str], writer: str,
                 limit: int) -> int | None:
    """The number of ``writer``'s seat among the first ``limit`` of ``seats`` (``held`` as
    ``_held_seats`` read them, ``own`` those holding ``writer``): its own, touched, else the
    first free one, taken unless it is one too many (``_one_too_many``); None when none is."""
    names = [SEAT_FILE.format(k) for k in range(limit)]
    seat = next((k for k, name in enumerate(names) if name in own), None)
    if seat is not None:
        _touch(seats, names[seat])  # in use again: not the orphan a reader may have judged it
        return seat
    seat = next((k for k, name in enumerate(names) if name not in held
                 and seats.lstat(name) is None and write_seat(seats, name, writer)), None)
    if seat is not None and _one_too_many(seats, names[seat], own, limit):
        seats.remove_file(names[seat])
        return None
    return seat


def _keep_one(seats: SafeDir, writer: str, seat: int, limit: int) -> int:
    """The seat ``writer``, seated at ``seat``, keeps: the lowest within ``limit`` holding its
    id now; every other one holding it is given back (one past ``limit``, or one taken at
    the same moment by another process of this host trying the same id: only one of them
    gets the segment's lock, and the other, trying its next id, would find no seat free).
    Seats that cannot be read for a moment: nothing is given back."""
    try:
        held = _held_seats(seats)
    except OSError:
        return seat
    ours = sorted((n, name) for name, holder in held.items()
                  if holder == writer and (n := seat_number(name)) is not None)
    kept = next((n for n, _ in ours if n < limit), seat)
    for n, name in ours:
        if n != kept:
            with contextlib.suppress(OSError):  # not a seat file of ours any more
                seats.remove_file(name)
    return kept


def _taken_under_own_id(path: str, writer: str) -> CacheDirError:
    """Why ``writer`` holds no seat though one holds its id: another process took it."""
    return CacheDirError(errno.EBUSY, f"a seat of {path} was taken under writer id {writer} "
                         "by another process claiming one at the same moment: that id is "
                         "the other process's; give each instance its own instance_id (or let "
                         "kvtier derive one: the next default id is tried)")


def _no_seat(path: str, others: list[str | None], limit: int) -> CacheDirError:
    """Why a writer holds no seat: ``others`` are the holders of the seats held by others
    now (None for an entry kvtier did not write)."""
    holders = ", ".join(sorted({h or "entries kvtier did not write" for h in others})) or "nobody"
    if len(others) >= limit:
        why = (f"{len(others)} writer seats of {path} are held (by {holders}) and "
               f"share_writers is {limit}")
    else:  # taken and given back again meanwhile
        why = (f"writers claiming seats of {path} at the same moment took the free ones "
               f"({len(others)} held by others now, by {holders}; share_writers is {limit})")
    return CacheDirError(errno.EDQUOT, f"{why}: this writer reads the others' chunks but writes "
                         "none; raise share_writers (each writer then holds disk_capacity / "
                         "share_writers), or wait for a writer that is gone to be reclaimed "
                         "(lease_timeout: this store reclaims it at the path's next try), or "
                         "remove a gone writer's segment with `kvtier gc PATH --gone AGE`")


def _held_seats(seats: SafeDir) -> dict[str, str | None]:
    """Each seat of ``seats`` and the writer it holds (``read_holder``), once the
    ``linked_temps`` are removed; ``UnsafeEntry`` when it holds more than ``SEATS_LISTED``
    entries."""
    listed = seats.listed(SEATS_LISTED)
    _remove_linked_temps(seats, listed)
    return {name: read_holder(seats, name) for name in listed if seat_number(name) is not None}


def _one_too_many(seats: SafeDir, name: str, own: set[str], limit: int) -> bool:
    """Whether seat ``name``, just taken, must be given back: more than ``limit`` seats are
    held (writers that counted the seats at once, each then taking one), and it is among
    the highest-numbered of the first ``limit``, which give way. Every writer that took a
    seat sees the same seats once each has taken its own, so just the excess gives way. The
    claimant's ``own`` other seats are not counted: it gives them back once it holds this."""
    held = sorted(n for n in (seat_number(entry) for entry in seats.listed(SEATS_LISTED)
                              if entry not in own) if n is not None)
    excess = len(held) - limit
    return excess > 0 and seat_number(name) in [n for n in held if n < limit][-excess:]


def _touch(seats: SafeDir, name: str) -> None:
    """Mark seat ``name`` modified now (``free_orphan_seats`` frees a seat only if it is
    unchanged since judged); a seat that cannot be touched is left as it is."""
    with contextlib.suppress(OSError):
        os.utime(name, dir_fd=seats.fd, follow_symlinks=False)


def _remove_linked_temps(seats: SafeDir, names: list[str]) -> None:
    """Remove the ``linked_temps`` among ``names``: the seat keeps the data, and reads again
    (one link)."""
    for name in linked_temps(seats, names):
        with contextlib.suppress(OSError):  # changed since: left alone
            seats.remove_file(name, links=2)


def holds_seat(ns_dir: SafeDir, writer: str, limit: int) -> bool:
    """Whether ``writer`` holds one of the first ``limit`` seats of the namespace open as
    ``ns_dir``. A seat that cannot be read (``read_holder`` raises: a process short of open
    files, an I/O error) may be its own: when no other is, that error is raised, and the
    caller counts it as "cannot be told"."""
    if ns_dir.lstat(SEATS_DIR) is None:
        return False
    unread: OSError | None = None
    with ns_dir.subdir(SEATS_DIR) as seats:
        for k in range(limit):
            try:
                if read_holder(seats, SEAT_FILE.format(k)) == writer:
                    return True
            except OSError as exc:
                unread = unread or exc
    if unread is not None:
        raise unread
    return False


def check_seated(root: Path, namespace_id: str, writer: str, share_writers: int,
                 segment: SafeDir) -> None:
    """With the segment's lock held: ``CacheDirError`` (EAGAIN) unless ``segment`` is still
    ``writer``'s directory and ``writer`` still holds a seat. A reclaim of the segment of a
    writer gone (``reclaim_segment``, which holds that lock throughout) may have run between
    the seat's claim and the lock: writing on would make a segment without a seat. When the
    seat cannot be told (``holds_seat`` raises), that error is raised: the path's try fails."""
    with SafeDir.open(root) as top, top.subdir(namespace_id) as ns_dir:
        with ns_dir.subdir(WRITERS_DIR) as writers:
            entry = writers.lstat(writer)
        if entry is None or entry.st_ino != segment.inode() \
                or not holds_seat(ns_dir, writer, share_writers):
            raise CacheDirError(errno.EAGAIN, f"the segment of {writer} in {root / namespace_id} "
                                "was reclaimed (as a writer gone) while this writer opened it; "
                                "it is opened again at the path's next try")


def still_seated(root: Path, namespace_id: str, writer: str, share_writers: int) -> bool:
    """Whether ``writer`` still holds a seat (its lease's check at each beat); True when that
    cannot be told (a seat or directory that cannot be read for a moment, such as a process
    short of open files: the path's own checks report a path that cannot be read)."""
    try:
        with SafeDir.open(root) as top, top.subdir(namespace_id) as ns_dir:
            return holds_seat(ns_dir, writer, share_writers)
    except OSError:
        return True


def reclaim_segment(ns_dir: SafeDir, writer: str, inode: int) -> bool:
    """Delete the segment of ``writer`` (a writer that is gone), if it is still the directory
    ``inode`` that was watched, and give back its seat: only files kvtier names, each a
    regular file of this user, with the segment's lock held throughout (a process of this
    host holding it is alive: nothing is touched). True when the segment is gone. Anything
    else in it stays, and so do the directory and the seat (nothing is given back that
    cannot be proven free), as with ``kvtier gc --gone`` (``ops.removal.remove_segment``).
    On NFS the lock file, removed while held, is only renamed (``.nfs*``) until it closes:
    the directory then stays, empty once the client deleted it, and the next reclaim
    removes it as it is (an empty segment holds nothing; its seat was given back)."""
    with ns_dir.subdir(WRITERS_DIR) as writers:
        try:
            segment = writers.subdir(writer)
        except FileNotFoundError:
            return False
        with segment:
            if segment.inode() != inode:
                return False  # made again since it was watched: a writer that came back
            if not segment.listed(SEGMENT_LISTED):  # emptied by an earlier reclaim (NFS)
                return writers.remove_dir(writer)
            try:
                lock = segment.open_file(LOCK_FILE, os.O_RDWR, create=True)
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False
            try:
                bare = _remove_all_but_lock(segment)
                # the seat goes while the lock file is still there and held: a writer coming
                # back under this id waits on it, then claims a seat afresh (or is not
                # seated), rather than finding its old seat (with a lock file made anew once
                # this one is gone) and losing it to this release
                if bare:
                    release_seat(ns_dir, writer)
                segment.remove_file(LOCK_FILE)
                if not bare or not writers.remove_dir(writer):
                    return False
            finally:
                os.close(lock)
    return True


def _remove_all_but_lock(segment: SafeDir) -> bool:
    """Remove the files kvtier names in ``segment`` but its lock (slot files, temporary files,
    lease, log, index); True when the lock file is all that is left (its bytes are gone)."""
    for name in segment.listed(SEGMENT_LISTED):
        if slot_number(name) is not None or TEMP_NAME.fullmatch(name):
            segment.remove_file(name)
    for name in _SEGMENT_FILES[:-1]:
        segment.remove_file(name)
    return segment.listed(SEGMENT_LISTED) == [LOCK_FILE]


def release_seat(ns_dir: SafeDir, writer: str) -> None:
    """Give back ``writer``'s seat (its segment is gone); ``seats/`` itself stays (a writer
    may be claiming a seat in it now). A seat that cannot be read (``read_holder`` raises)
    may be the writer's: its error is raised, and no seat is given back."""
    if ns_dir.lstat(SEATS_DIR) is None:
        return
    with ns_dir.subdir(SEATS_DIR) as seats:
        own = [name for name in seats.listed(SEATS_LISTED)
               if seat_number(name) is not None and read_holder(seats, name) == writer]
        for name in own:
            seats.remove_file(name)
