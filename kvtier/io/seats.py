"""Seats: how ``disk_capacity`` stays a hard bound for a namespace's directory shared by many
writers, and how the segment of a writer that is gone is handed back.

A writer holds a segment only while it holds one of ``share_writers`` seats: a file
``seats/seat-NNNN`` holding its id, made with ``O_EXCL`` (atomic on local and network
filesystems alike), so at most ``share_writers`` segments exist and each holds at most
``disk_capacity / share_writers``. A writer that restarts finds its own seat again. A seat
is given back only with its segment, when the segment is reclaimed: never while the
segment's bytes are on disk.
"""

from __future__ import annotations

import errno
import fcntl
import os

from kvtier.io.names import (
    INDEX_FILE,
    LEASE_FILE,
    LOCK_FILE,
    LOG_FILE,
    SEAT_FILE,
    SEAT_NAME,
    SEATS_DIR,
    SLOT_NAME,
    WRITERS_DIR,
)
from kvtier.io.safefs import CacheDirError, SafeDir

_SEAT_BYTES = 256  # a writer id is at most 64 characters
_SEGMENT_FILES = (LEASE_FILE, LOG_FILE, INDEX_FILE, LOCK_FILE)  # the lock goes last


def _holder(seats: SafeDir, name: str) -> str | None:
    try:
        data = seats.read_file(name, _SEAT_BYTES)
    except OSError:
        return None  # not a seat kvtier wrote: it stays taken
    return data.decode("utf-8", "replace").strip() if data is not None else None


def claim_seat(ns_dir: SafeDir, writer: str, limit: int) -> int:
    """The number of ``writer``'s seat in the namespace open as ``ns_dir``: the one it holds
    already, else the first free one, taken. ``CacheDirError`` (EDQUOT) when all ``limit``
    seats are held by other writers."""
    with ns_dir.subdir(SEATS_DIR, create=True) as seats:
        names = [SEAT_FILE.format(k) for k in range(limit)]
        for k, name in enumerate(names):
            if _holder(seats, name) == writer:
                return k
        for k, name in enumerate(names):
            try:
                fd = seats.open_file(name, os.O_WRONLY | os.O_EXCL, create=True)
            except FileExistsError:
                continue
            try:
                os.write(fd, writer.encode())
            finally:
                os.close(fd)
            return k
        holders = sorted(filter(None, (_holder(seats, n) for n in names)))
    raise CacheDirError(errno.EDQUOT, f"all {limit} writer seats of {ns_dir.path} are held "
                        f"(by {', '.join(holders) or 'entries kvtier did not write'}): this "
                        "writer reads the others' chunks but writes none; raise share_writers "
                        "(each writer then holds disk_capacity / share_writers), or wait for "
                        "a writer that is gone to be reclaimed (lease_timeout)")


def held_here(segment: SafeDir) -> bool:
    """True when a process of this host holds the segment's lock (it is alive, whatever its
    lease says), or when that cannot be told (a lock that cannot be opened or tried: the
    cautious answer)."""
    try:
        fd = segment.open_file(LOCK_FILE, os.O_RDWR)  # NFS locks need a file open for writing
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
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
                for name in segment.names():
                    if SLOT_NAME.fullmatch(name) or name.startswith(f".{LEASE_FILE}.tmp-") \
                            or name.startswith(f".{LOG_FILE}.tmp-"):
                        segment.remove_file(name)
                for name in _SEGMENT_FILES:
                    segment.remove_file(name)
                if not writers.remove_dir(writer):
                    return False
                release_seat(ns_dir, writer)
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
            if SEAT_NAME.fullmatch(name) and _holder(seats, name) == writer:
                seats.remove_file(name)
