"""The files of a namespace's ``seats/`` directory: how a seat is made crash-safely
(``write_seat``), and what they say: the writer a seat holds, whether a file is provably
kvtier's, and which temporary files of ``write_seat`` are already linked to their seat
(``kvtier.segment.seats``)."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import TypeGuard

from kvtier.io.safefs import SafeDir, UnsafeEntry
from kvtier.segment.names import TEMP_NAME, seat_number

_SEAT_BYTES = 256  # a writer id is at most 64 characters
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}  # no hard links here


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
