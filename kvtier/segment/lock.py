"""A segment's lock file (``lock``), held with ``flock`` by the process writing the segment:
taking it, and telling whether a process of this host holds it (nothing taken)."""

from __future__ import annotations

import errno
import fcntl
import os

from kvtier.io.safefs import CacheDirError, SafeDir
from kvtier.segment.names import LOCK_FILE


def lock_namespace(directory: SafeDir, advice: str) -> int:
    """Hold ``directory``'s lock file (``flock``, exclusive) and return its descriptor; raise
    ``CacheDirError`` (EBUSY) with ``advice`` when another process holds it."""
    fd = directory.open_file(LOCK_FILE, os.O_RDWR, create=True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CacheDirError(errno.EBUSY, f"{directory.path} is in use by another kvtier "
                            f"process; {advice}") from None
    return fd


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
