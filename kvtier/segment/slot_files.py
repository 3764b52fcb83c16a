"""The sizes of a segment's slot files: grown in large preallocated steps, never past the
capacity nor below the filesystem's free-space floor, and cut back to the capacity when it
shrank (``CacheDir`` holds the files open)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable

from kvtier.config.settings import DiskFloor
from kvtier.io.safefs import SafeDir
from kvtier.segment.names import SEGMENT_LISTED, slot_number

GROW_BYTES = 256 * 1024**2


def floor_allows(floor: DiskFloor, fd: int, grow: int) -> bool:
    """True when growing by ``grow`` bytes leaves the filesystem of ``fd`` above ``floor``."""
    st = os.fstatvfs(fd)
    free = st.f_bavail * st.f_frsize
    return free - grow >= max(floor.bytes, int(floor.fraction * st.f_blocks * st.f_frsize))


def grow_file(fd: int, size: int, end: int, limit: int, floor: DiskFloor, dir_fd: int) -> int | None:
    """Preallocate slot file ``fd`` (``size`` bytes now) to at least ``end`` bytes and return
    its new size: a big step (``GROW_BYTES``, never past ``limit``), else just what is
    needed; None when neither leaves the filesystem of ``dir_fd`` above ``floor``."""
    step = min(max(end, size + GROW_BYTES), limit)
    for target in dict.fromkeys((step, end)):  # a big step, else just what is needed
        if not floor_allows(floor, dir_fd, target - size):
            continue
        try:
            os.posix_fallocate(fd, size, target - size)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or target == end:
                raise
            continue
        return target
    return None


def trim_slot_files(directory: SafeDir, limit_of: Callable[[int], int]) -> None:
    """Cut every slot file of ``directory`` down to ``limit_of(its number)`` bytes, and remove
    those with no room left; a slot file that is not a regular file of ours is refused."""
    for name in directory.listed(SEGMENT_LISTED):
        number = slot_number(name)
        if number is None:
            continue  # not a name kvtier writes: never truncated nor removed
        limit = limit_of(number)
        fd = directory.open_file(name, os.O_RDWR)
        try:
            if os.fstat(fd).st_size > limit:
                os.ftruncate(fd, limit)
        finally:
            os.close(fd)
        if limit == 0:
            directory.remove_file(name)


NO_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.ENOSYS}  # filesystems that sync none


def sync_segment(slot_fds: Iterable[int], index_fd: int, dir_fd: int) -> None:
    """Make a segment durable (``fdatasync``) in the order a restart trusts it: every slot
    file, then the index, then the directory (so that files made since it opened are found).

    The index is written through the page cache, and a restart adopts what it names without
    reading the slots. Left to the kernel's write-back, a power loss or kernel crash even
    after a clean close can leave it older than the slots: entries naming chunks since
    overwritten (a miss counted as corrupt at the first read, and not stored again until
    then), none for the chunks written since (lost: only a missing index is rebuilt from
    the slot headers), or an index never written back (a full scan at the next start). Synced after
    the slots (whose ``O_DIRECT`` writes the same call makes durable: a drive's write cache,
    the extents they filled), it names no chunk written before the sync began that a slot
    does not hold (a write over between the two syncs may leave an entry naming bytes not on
    the disk: its checksum makes it a miss; ``KVStore.flush`` does not vouch for it,
    ``kvtier.store.sync_watch``). ``log.kvt`` and the
    lease need no sync: the log starts afresh from the index at every open, and a lease a
    power loss left open is a writer gone (its host booted since). Errors (``OSError``) are
    the caller's; a filesystem that cannot sync a directory is taken as it is."""
    for fd in slot_fds:
        os.fdatasync(fd)
    os.fdatasync(index_fd)
    sync_if_able(dir_fd)


def sync_if_able(fd: int) -> None:
    """``fsync`` ``fd``, on a filesystem that syncs anything (``NO_SYNC``: one that syncs
    nothing loses nothing by it)."""
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in NO_SYNC:
            raise
