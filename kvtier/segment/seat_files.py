"""What the files of a namespace's ``seats/`` directory say: the writer a seat holds, whether a
file is provably kvtier's, and which temporary files of ``write_seat`` are already linked to
their seat (``kvtier.segment.seats``)."""

from __future__ import annotations

import os
import stat
from typing import TypeGuard

from kvtier.io.safefs import SafeDir, UnsafeEntry
from kvtier.segment.names import TEMP_NAME, seat_number

_SEAT_BYTES = 256  # a writer id is at most 64 characters


def read_holder(seats: SafeDir, name: str) -> str | None:
    """The writer id seat ``name`` of ``seats`` holds; None when it is missing, empty, or
    not a seat kvtier wrote (``UnsafeEntry``, or a file this process may not read: kvtier
    writes its seats 0600, as their owner; such a seat stays taken). Any other error (a
    process short of open files, an I/O error) is raised: who holds the seat cannot be told
    then, and each caller says what that means for it."""
    try:
        data = seats.read_file(name, _SEAT_BYTES)
    except (UnsafeEntry, PermissionError):
        return None  # not a seat kvtier wrote: it stays taken
    return data.decode("utf-8", "replace").strip() if data is not None else None


def mine(info: os.stat_result | None) -> TypeGuard[os.stat_result]:
    """A regular file of this user (``lstat``: a symlink is not followed)."""
    return info is not None and stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def linked_temps(seats: SafeDir, names: list[str]) -> set[str]:
    """The temporary files of ``write_seat`` already linked to their seat (a crash between
    the link and the unlink): each of this user, with two links, the other a seat file in
    ``seats`` (the same inode), so removing it loses nothing. Among ``names`` (a listing of
    ``seats`` within its bound)."""
    seat_inodes = set()
    for name in names:
        info = seats.lstat(name) if seat_number(name) is not None else None
        if mine(info):
            seat_inodes.add((info.st_dev, info.st_ino))
    linked = set()
    for name in names:
        info = seats.lstat(name) if TEMP_NAME.fullmatch(name) else None
        if mine(info) and info.st_nlink == 2 and (info.st_dev, info.st_ino) in seat_inodes:
            linked.add(name)
    return linked
