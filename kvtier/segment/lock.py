"""A segment's lock file (``lock``), held with ``flock`` by the process writing the segment:
taking it, and telling whether a process of this host holds it (nothing taken)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time

from kvtier.io.safefs import CacheDirError, SafeDir
from kvtier.segment.names import LOCK_FILE

BUSY_WAIT_S = 0.2  # how long taking a segment waits out a lock held for a moment
_KEPT: set[int] = set()  # lock descriptors held for as long as a segment is open


def keep(fd: int) -> int:
    """``fd``, a lock held for as long as its segment is open: a child this process forks
    closes it (``let_go`` before closing it here). A child keeps its parent's descriptors,
    so a helper forked by a writer later killed would hold the lock, and keep the writer
    out of its own segment when it starts again, for as long as the helper lives."""
    _KEPT.add(fd)
    return fd


def let_go(fd: int) -> None:
    _KEPT.discard(fd)
    os.close(fd)


def _close_kept_in_child() -> None:
    """In a forked child, each kept lock descriptor is made ``/dev/null`` (``dup2`` closes
    the lock's: never ``LOCK_UN``, which would release the parent's lock too). The number
    stays taken, so the child's inherited objects, closing it later, close nothing else."""
    if not _KEPT:
        return
    try:
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    except OSError:  # (no /dev/null, no descriptor left): closed, then
        null = -1
    for fd in _KEPT:
        with contextlib.suppress(OSError):
            if null >= 0:
                os.dup2(null, fd, inheritable=False)
            else:
                os.close(fd)
    if null >= 0:
        os.close(null)
    _KEPT.clear()


os.register_at_fork(after_in_child=_close_kept_in_child)


def lock_namespace(directory: SafeDir, advice: str) -> int:
    """Hold ``directory``'s lock file (``flock``, exclusive) and return its descriptor; raise
    ``CacheDirError`` (EBUSY) with ``advice`` when another process holds it. A lock held
    for a moment (``locked_here``'s look, from ``kvtier inspect`` or another engine) is
    waited out: it is tried again for ``BUSY_WAIT_S``."""
    fd = directory.open_file(LOCK_FILE, os.O_RDWR, create=True)
    deadline = time.monotonic() + BUSY_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise CacheDirError(errno.EBUSY, f"{directory.path} is in use by another "
                                    f"kvtier process; {advice}") from None
            time.sleep(BUSY_WAIT_S / 10)
        except BaseException:
            os.close(fd)
            raise


def held_here(segment: SafeDir) -> bool:
    """True when a process of this host holds the segment's lock (it is alive, whatever its
    lease says), or when that cannot be told (a lock that cannot be opened or tried: the
    cautious answer)."""
    return locked_here(segment) is not False


def locked_here(segment: SafeDir) -> bool | None:
    """Whether a process of this host holds the segment's lock; None when that cannot be
    told (a lock file that cannot be opened or tried). Nothing is kept: the look holds a
    shared lock for a moment, which no other look conflicts with, and which a writer taking
    the segment then (``lock_namespace``) waits out."""
    try:
        fd = _open_lock(segment)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _open_lock(segment: SafeDir) -> int:
    """The segment's lock file, open for a look: for writing (NFS locks need it), or on a
    read-only mount (``EROFS``) for reading, which a shared lock needs alone (a process of
    this host writing through another mount of the filesystem holds it all the same)."""
    try:
        return segment.open_file(LOCK_FILE, os.O_RDWR)
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise
    return segment.open_file(LOCK_FILE, os.O_RDONLY)
