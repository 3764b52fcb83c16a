"""Mount points among a directory's entries, found without touching them.

Whoever can write a shared cache directory can mount a file system of their own on a
directory there (FUSE lets a user mount on a directory they own). Every look at a mount
point, even an ``lstat`` of its name, goes to that file system, and a FUSE server that
stops answering holds the caller for ever. The mount points are read from this process's
mount table instead (``/proc/self/mountinfo``), so that the caller passes them over
unlooked at. The same table says which mount a path is under (``mount_of``).
"""

from __future__ import annotations

import os
import re

MOUNTINFO = "/proc/self/mountinfo"
MAX_TABLE = 16 * 2**20  # bytes of the mount table read at most
_ESCAPE = re.compile(rb"\\([0-7]{3})")  # mountinfo escapes space, tab, newline, backslash


def mount_points(table: str = MOUNTINFO) -> frozenset[str]:
    """The mount points of this process's mount table (none where it cannot be read: no
    ``/proc``)."""
    return frozenset(point for _, point in _mounts(table))


def mount_of(path: str, table: str = MOUNTINFO) -> int | None:
    """The ID of the mount ``path`` is under, from the mount table alone (a hung mount
    cannot hold it): the one whose mount point is the longest leading part of ``path``
    (made absolute, its symlinks not followed: that would ask the file system), the last
    listed of equals (mounted on top). A mount lazily unmounted and mounted anew at the same
    place has a new ID. None where the table cannot be read."""
    where = os.path.abspath(path)
    best: tuple[int, int] | None = None  # (length of its mount point, its ID)
    for mount_id, point in _mounts(table):
        under = point == "/" or where == point or where.startswith(point.rstrip("/") + "/")
        if under and (best is None or len(point) >= best[0]):
            best = (len(point), mount_id)
    return None if best is None else best[1]


def _mounts(table: str) -> list[tuple[int, str]]:
    """(mount ID, mount point) of each line of the mount table; none where it cannot be read."""
    try:
        with open(table, "rb") as f:
            text = f.read(MAX_TABLE)
    except OSError:
        return []
    mounts = []
    for line in text.splitlines():
        fields = line.split(b" ", 5)
        if len(fields) >= 5 and fields[0].isdigit():
            point = os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m[1], 8)]), fields[4]))
            mounts.append((int(fields[0]), point))
    return mounts


def is_mounted(points: frozenset[str], directory_fd: int, name: str) -> bool:
    """Whether entry ``name`` of the directory open as ``directory_fd`` is one of ``points``
    (``mount_points``), found by the kernel's path of that directory, not by looking."""
    if not points:
        return False
    try:
        where = os.readlink(f"/proc/self/fd/{directory_fd}")
    except OSError:
        return False
    return f"{where.rstrip('/')}/{name}" in points
