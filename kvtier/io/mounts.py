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
from collections.abc import Sequence

MOUNTINFO = "/proc/self/mountinfo"
MAX_TABLE = 16 * 2**20  # bytes of the mount table read at most
_ESCAPE = re.compile(rb"\\([0-7]{3})")  # mountinfo escapes space, tab, newline, backslash


def mount_points(table: str = MOUNTINFO) -> frozenset[str]:
    """The mount points of this process's mount table (none where it cannot be read: no
    ``/proc``)."""
    return frozenset(point for _, point in _mounts(table))


def mount_of(path: str, table: str = MOUNTINFO) -> int | None:
    """The ID of the mount ``path`` is under (``mounted_at``). A mount lazily unmounted and
    mounted anew at the same place has a new ID. None where the table cannot be read."""
    mount = mounted_at(path, table)
    return None if mount is None else mount[0]


def mounts_of(paths: Sequence[str], table: str = MOUNTINFO) -> list[int | None]:
    """``mount_of`` each of ``paths``, the mount table read once."""
    mounts = _mounts(table)
    return [None if (mount := _over(path, mounts)) is None else mount[0] for path in paths]


def mounted_at(path: str, table: str = MOUNTINFO) -> tuple[int, str] | None:
    """(ID, mount point) of the mount ``path`` is under, from the mount table alone (a hung
    mount cannot hold it): the one whose mount point is the longest leading part of ``path``
    (made absolute, its symlinks not followed: that would ask the file system), the last
    listed of equals (mounted on top). None where the table cannot be read."""
    return _over(path, _mounts(table))


def _over(path: str, mounts: list[tuple[int, str]]) -> tuple[int, str] | None:
    """The mount of ``mounts`` that ``path`` is under (``mounted_at``)."""
    where = os.path.abspath(path)
    best: tuple[int, str] | None = None
    for mount_id, point in mounts:
        under = point == "/" or where == point or where.startswith(point.rstrip("/") + "/")
        if under and (best is None or len(point) >= len(best[1])):
            best = (mount_id, point)
    return best


def mount_point_of(path: str, table: str = MOUNTINFO) -> str | None:
    """The mount point of the mount ``path`` is under (``mounted_at``)."""
    mount = mounted_at(path, table)
    return None if mount is None else mount[1]


def fell_through(path: str, opened_on: str | None, table: str = MOUNTINFO) -> str | None:
    """The mount point ``path`` is on now, when that is nearer ``/`` than ``opened_on``, the
    one it was on when opened: the file system mounted there is gone, and the path is a
    plain directory of the one beneath (a network mount unmounted: the root disk, say).
    None when it is not so, or cannot be told."""
    now = mount_point_of(path, table)
    if opened_on is None or now is None or len(now) >= len(opened_on):
        return None
    return now


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


def holding_mounts(points: frozenset[str], directory_fd: int) -> set[str]:
    """The entries of the directory open as ``directory_fd`` that are one of ``points``
    (``mount_points``) or hold one below them (a file system mounted on a file of a
    writer's segment), found by the kernel's path of that directory, not by looking."""
    where = _path_of(directory_fd) if points else None
    return set() if where is None else {
        point[len(where):].split("/", 1)[0] for point in points if point.startswith(where)}


def is_mounted(points: frozenset[str], directory_fd: int, name: str) -> bool:
    """Whether entry ``name`` of the directory open as ``directory_fd`` is one of ``points``
    (``mount_points``), found by the kernel's path of that directory, not by looking."""
    where = _path_of(directory_fd) if points else None
    return where is not None and f"{where}{name}" in points


def _path_of(directory_fd: int) -> str | None:
    """The kernel's path of the directory open as ``directory_fd``, with a trailing slash."""
    try:
        return os.readlink(f"/proc/self/fd/{directory_fd}").rstrip("/") + "/"
    except OSError:
        return None
