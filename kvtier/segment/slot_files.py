"""The sizes of a segment's slot files: grown in large preallocated steps, never past the
capacity nor below the filesystem's free-space floor, and cut back to the capacity when it
shrank (``CacheDir`` holds the files open)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

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
