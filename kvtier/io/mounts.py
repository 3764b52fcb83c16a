"""Mount points among a directory's entries, found without touching them.

Whoever can write a shared cache directory can mount a file system of their own on a
directory there (FUSE lets a user mount on a directory they own). Every look at a mount
point, even an ``lstat`` of its name, goes to that file system, and a FUSE server that
stops answering holds the caller for ever. The mount points are read from this process's
mount table instead (``/proc/self/mountinfo``), so that the caller passes them over
unlooked at.
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
    try:
        with open(table, "rb") as f:
            text = f.read(MAX_TABLE)
    except OSError:
        return frozenset()
    points = set()
    for line in text.splitlines():
        fields = line.split(b" ", 5)
        if len(fields) >= 5:
            points.add(os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m[1], 8)]), fields[4])))
    return frozenset(points)


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
