"""Seats: how ``disk_capacity`` stays a hard bound for a namespace's directory shared by many
writers, and how the segment of a writer that is gone is handed back.

A writer holds a segment only while it holds one of ``share_writers`` seats: a file
``seats/seat-NNNN`` holding its id, so at most ``share_writers`` segments exist and each
holds at most ``disk_capacity / share_writers``. A seat is made crash-safely
(``write_seat``): the id is written and synced under a temporary name, then hard-linked to
the seat's name, which is atomic and never replaces a seat (on local and network
filesystems alike), so a seat is whole or absent. A writer that restarts finds its own seat
again. A seat is given back only with its segment, when the segment is reclaimed: never
while the segment's bytes are on disk. A seat that names no writer with a segment (empty or
unreadable: a crash of a version that wrote seats in place; or a writer that crashed before
it made its segment) is an orphan, given back once it stood unchanged long enough
(``orphan_seats``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import secrets
import stat
import time
from collections.abc import Callable
from typing import TypeGuard

from kvtier.io.safefs import CacheDirError, SafeDir
from kvtier.segment.names import (
    INDEX_FILE,
    LEASE_FILE,
    LOCK_FILE,
    LOG_FILE,
    SEAT_FILE,
    SEATS_DIR,
    TEMP_NAME,
    WRITER_ID,
    WRITERS_DIR,
    seat_number,
    slot_number,
)

_SEAT_BYTES = 256  # a writer id is at most 64 characters
_SEGMENT_FILES = (LEASE_FILE, LOG_FILE, INDEX_FILE, LOCK_FILE)  # the lock goes last
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}  # no hard links here


def read_holder(seats: SafeDir, name: str) -> str | None:
    """The writer id seat ``name`` of ``seats`` holds; None when it is empty, unreadable or
    not a seat kvtier wrote (it stays taken)."""
    try:
        data = seats.read_file(name, _SEAT_BYTES)
    except OSError:
        return None  # not a seat kvtier wrote: it stays taken
    return data.decode("utf-8", "replace").strip() if data is not None else None


def write_seat(seats: SafeDir, name: str, writer: str) -> bool:
    """Make seat ``name`` in ``seats`` hold ``writer``, crash-safely; False when it is taken.

    The id is written and synced to a new temporary file, which is then hard-linked to
    ``name`` (atomic; ``EEXIST`` when the seat exists: it is never replaced) and unlinked.
    A crash leaves no seat or a whole one, and perhaps the temporary file (``orphan_seats``
    and ``kvtier clear`` remove it). Where hard links are not supported the seat is made in
    place (``O_EXCL``), then synced."""
    temp = f".seat.tmp-{os.getpid()}-{secrets.token_hex(4)}"  # a ``TEMP_NAME``
    fd = seats.open_file(temp, os.O_WRONLY | os.O_EXCL, create=True)
    try:
        _write_synced(fd, writer.encode(), seats.path)
        os.close(fd)
        fd = -1
        os.link(temp, name, src_dir_fd=seats.fd, dst_dir_fd=seats.fd, follow_symlinks=False)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        return _write_in_place(seats, name, writer)
    finally:
        if fd >= 0:
            os.close(fd)
        seats.remove_file(temp, links=2)  # linked to the seat just made, or not
    os.fsync(seats.fd)  # the seat's name is on disk before the writer counts on it
    return True


def _write_in_place(seats: SafeDir, name: str, writer: str) -> bool:
    try:
        fd = seats.open_file(name, os.O_WRONLY | os.O_EXCL, create=True)
    except FileExistsError:
        return False
    try:
        _write_synced(fd, writer.encode(), seats.path)
    finally:
        os.close(fd)
    return True


def _write_synced(fd: int, data: bytes, where: str) -> None:
    if os.write(fd, data) != len(data):
        raise OSError(errno.EIO, f"short write of a seat in {where}")
    os.fsync(fd)


def claim_seat(ns_dir: SafeDir, writer: str, limit: int) -> int:
    """The number of ``writer``'s seat in the namespace open as ``ns_dir``: the one it holds
    already among the first ``limit``, else the first free one, taken (``write_seat``); a
    seat of its own past ``limit`` (from a run with a larger ``share_writers``) is given back
    once it holds one within. ``CacheDirError`` (EDQUOT) when the seats held otherwise,
    whatever their number, are ``limit`` or more: a seat past ``limit`` is that of a writer
    that ran with a larger ``share_writers``, whose segment still takes its share of
    ``disk_capacity`` until it is reclaimed."""
    with ns_dir.subdir(SEATS_DIR, create=True) as seats:
        _remove_linked_temps(seats)
        held = {name: read_holder(seats, name) for name in seats.names() if seat_number(name) is not None}
        names = [SEAT_FILE.format(k) for k in range(limit)]
        others = sorted(name for name, holder in held.items() if holder != writer)
        seat = None
        if len(others) < limit:
            seat = next((k for k, name in enumerate(names) if held.get(name) == writer), None)
            if seat is not None:
                _touch(seats, names[seat])  # in use again: not the orphan a reader may have judged it
            else:
                seat = next((k for k, name in enumerate(names)
                             if name not in held and seats.lstat(name) is None
                             and write_seat(seats, name, writer)), None)
                if seat is not None and _one_too_many(seats, names[seat], limit):
                    seats.remove_file(names[seat])
                    seat = None
        if seat is not None:
            for name, holder in held.items():
                if holder == writer and name != names[seat]:
                    with contextlib.suppress(OSError):  # not a seat file of ours any more
                        seats.remove_file(name)
            return seat
        holders = sorted({holder or "entries kvtier did not write" for holder in
                          (held[name] for name in others)})
    raise CacheDirError(errno.EDQUOT, f"{len(others)} writer seats of {ns_dir.path} are held "
                        f"(by {', '.join(holders) or 'nobody'}) and share_writers is {limit}: "
                        "this writer reads the others' chunks but writes none; raise "
                        "share_writers (each writer then holds disk_capacity / share_writers), "
                        "or wait for a writer that is gone to be reclaimed (lease_timeout: "
                        "this store reclaims it at the path's next try), or remove a gone "
                        "writer's segment with `kvtier gc PATH --gone AGE`")


def _one_too_many(seats: SafeDir, name: str, limit: int) -> bool:
    """Whether seat ``name``, just taken, must be given back: more than ``limit`` seats are
    held (writers that counted the seats at once, each then taking one), and it is among
    the highest-numbered of the first ``limit``, which give way. Every writer that took a
    seat sees the same seats once each has taken its own, so just the excess gives way."""
    held = sorted(n for n in (seat_number(name) for name in seats.names()) if n is not None)
    excess = len(held) - limit
    return excess > 0 and seat_number(name) in [n for n in held if n < limit][-excess:]


def _touch(seats: SafeDir, name: str) -> None:
    """Mark seat ``name`` modified now (``free_orphan_seats`` frees a seat only if it is
    unchanged since judged); a seat that cannot be touched is left as it is."""
    with contextlib.suppress(OSError):
        os.utime(name, dir_fd=seats.fd, follow_symlinks=False)


def _mine(info: os.stat_result | None) -> TypeGuard[os.stat_result]:
    """A regular file of this user (``lstat``: a symlink is not followed)."""
    return info is not None and stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def linked_temps(seats: SafeDir) -> set[str]:
    """The temporary files of ``write_seat`` already linked to their seat (a crash between
    the link and the unlink): each of this user, with two links, the other a seat file in
    ``seats`` (the same inode), so removing it loses nothing."""
    names = seats.names()
    seat_inodes = set()
    for name in names:
        info = seats.lstat(name) if seat_number(name) is not None else None
        if _mine(info):
            seat_inodes.add((info.st_dev, info.st_ino))
    linked = set()
    for name in names:
        info = seats.lstat(name) if TEMP_NAME.fullmatch(name) else None
        if _mine(info) and info.st_nlink == 2 and (info.st_dev, info.st_ino) in seat_inodes:
            linked.add(name)
    return linked


def _remove_linked_temps(seats: SafeDir) -> None:
    """Remove the ``linked_temps``: the seat keeps the data, and reads again (one link)."""
    for name in linked_temps(seats):
        with contextlib.suppress(OSError):  # changed since: left alone
            seats.remove_file(name, links=2)


def holds_seat(ns_dir: SafeDir, writer: str, limit: int) -> bool:
    """Whether ``writer`` holds one of the first ``limit`` seats of the namespace open as
    ``ns_dir``."""
    if ns_dir.lstat(SEATS_DIR) is None:
        return False
    with ns_dir.subdir(SEATS_DIR) as seats:
        return any(read_holder(seats, SEAT_FILE.format(k)) == writer for k in range(limit))


def held_here(segment: SafeDir) -> bool:
    """True when a process of this host holds the segment's lock (it is alive, whatever its
    lease says), or when that cannot be told (a lock that cannot be opened or tried: the
    cautious answer)."""
    return locked_here(segment) is not False


def locked_here(segment: SafeDir) -> bool | None:
    """Whether a process of this host holds the segment's lock; None when that cannot be
    told (a lock file that cannot be opened or tried). Nothing is taken."""
    try:
        fd = segment.open_file(LOCK_FILE, os.O_RDWR)  # NFS locks need a file open for writing
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def reclaim_segment(ns_dir: SafeDir, writer: str, inode: int) -> bool:
    """Delete the segment of ``writer`` (a writer that is gone), if it is still the directory
    ``inode`` that was watched, and give back its seat: only files kvtier names, each a
    regular file of this user, with the segment's lock held throughout (a process of this
    host holding it is alive: nothing is touched). True when the segment is gone. Anything
    else in it stays, and so do the segment and its seat (nothing is given back that cannot
    be proven free)."""
    with ns_dir.subdir(WRITERS_DIR) as writers:
        try:
            segment = writers.subdir(writer)
        except FileNotFoundError:
            return False
        with segment:
            if segment.inode() != inode:
                return False  # made again since it was watched: a writer that came back
            try:
                lock = segment.open_file(LOCK_FILE, os.O_RDWR, create=True)
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False
            try:
                for name in segment.names():  # slot files, and temporary or probe files
                    if slot_number(name) is not None or TEMP_NAME.fullmatch(name):
                        segment.remove_file(name)
                for name in _SEGMENT_FILES:
                    segment.remove_file(name)
                # the seat goes before the directory, the lock still held: a writer coming
                # back under this id after the seat is gone claims one afresh (or is not
                # seated), rather than finding its old seat and losing it to this release
                release_seat(ns_dir, writer)
                if not writers.remove_dir(writer):
                    return False
            finally:
                os.close(lock)
    return True


def release_seat(ns_dir: SafeDir, writer: str) -> None:
    """Give back ``writer``'s seat (its segment is gone); ``seats/`` itself stays (a writer
    may be claiming a seat in it now)."""
    if ns_dir.lstat(SEATS_DIR) is None:
        return
    with ns_dir.subdir(SEATS_DIR) as seats:
        for name in seats.names():
            if seat_number(name) is not None and read_holder(seats, name) == writer:
                seats.remove_file(name)


def orphan_seats(ns_dir: SafeDir, older_than_s: float | None,
                 now_ns: int | None = None) -> list[tuple[str, os.stat_result]]:
    """The seats of the namespace open as ``ns_dir`` that name no writer with a segment
    (empty, unreadable, or naming a writer whose ``writers/<id>`` does not exist), the
    temporary files of ``write_seat`` and the ``linked_temps``, each with its ``lstat``,
    last modified ``older_than_s`` seconds or more ago by this machine's clock (a seat is
    whole before it has its name, and its writer makes its segment just after: neither is
    that old), or whatever their times with ``None`` (for a caller that judges by watching:
    ``OrphanWatch``). Changes nothing, and lists only what is provably kvtier's: regular
    files of this user with one link, or a linked temporary file (a seat that still has its
    temporary file's link is judged once that is gone)."""
    if ns_dir.lstat(SEATS_DIR) is None:
        return []
    cutoff = math.inf if older_than_s is None else (
        (time.time_ns() if now_ns is None else now_ns) - older_than_s * 1e9)  # never overflows
    found = []
    with ns_dir.subdir(SEATS_DIR) as seats:
        linked = linked_temps(seats)
        for name in seats.names():
            info = seats.lstat(name)
            if not _mine(info) or info.st_mtime_ns > cutoff:
                continue
            if name in linked or (info.st_nlink == 1 and (TEMP_NAME.fullmatch(name) or (
                    seat_number(name) is not None
                    and not _has_segment(ns_dir, read_holder(seats, name))))):
                found.append((name, info))
    return found


def _has_segment(ns_dir: SafeDir, writer: str | None) -> bool:
    """True when ``writer`` is a writer id whose ``writers/<id>`` entry exists (or when that
    cannot be told: the cautious answer)."""
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
        linked = linked_temps(seats)
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
