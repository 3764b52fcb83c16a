"""The seats ``kvtier gc --gone`` gives back: those that name no writer with a segment
(``kvtier.io.seats``), found without changing anything (a dry run lists what would go) and
given back only when provably kvtier's: a regular file of this user with one link, or a
temporary file of ``write_seat`` whose only other link is a seat beside it."""

from __future__ import annotations

import os
import stat
import time
from typing import TypeGuard

from kvtier.io.names import SEATS_DIR, TEMP_NAME, WRITER_ID, WRITERS_DIR, seat_number
from kvtier.io.safefs import SafeDir
from kvtier.ops.removal import remove_own_file

_SEAT_BYTES = 256  # a writer id is at most 64 characters


def _mine(info: os.stat_result | None) -> TypeGuard[os.stat_result]:
    """A regular file of this user (``lstat``: a symlink is not followed)."""
    return info is not None and stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def linked_temps(seats: SafeDir) -> set[str]:
    """The temporary files of ``write_seat`` already linked to their seat (a crash between
    the link and the unlink): each of this user, with two links, the other a seat file in
    ``seats`` (the same inode), so removing it loses nothing."""
    names = seats.names()
    seat_inodes = set()
    for name in names:
        info = seats.lstat(name) if seat_number(name) is not None else None
        if _mine(info):
            seat_inodes.add((info.st_dev, info.st_ino))
    linked = set()
    for name in names:
        info = seats.lstat(name) if TEMP_NAME.fullmatch(name) else None
        if _mine(info) and info.st_nlink == 2 and (info.st_dev, info.st_ino) in seat_inodes:
            linked.add(name)
    return linked


def _holder(seats: SafeDir, name: str) -> str | None:
    try:
        data = seats.read_file(name, _SEAT_BYTES)
    except OSError:
        return None  # unreadable: an orphan, as ``kvtier.io.seats`` counts it
    return data.decode("utf-8", "replace").strip() if data is not None else None


def _has_segment(ns_dir: SafeDir, writer: str | None) -> bool:
    """True when ``writer`` is a writer id whose ``writers/<id>`` entry exists (or when that
    cannot be told: the cautious answer)."""
    if not writer or not WRITER_ID.fullmatch(writer):
        return False
    try:
        if ns_dir.lstat(WRITERS_DIR) is None:
            return False
        with ns_dir.subdir(WRITERS_DIR) as writers:
            return writers.lstat(writer) is not None
    except OSError:
        return True


def orphan_seats(ns_dir: SafeDir, older_than_s: float,
                 now_ns: int | None = None) -> list[tuple[str, os.stat_result]]:
    """The seats of the namespace open as ``ns_dir`` that name no writer with a segment
    (empty, unreadable, or naming a writer whose ``writers/<id>`` does not exist), the
    temporary files of ``write_seat`` and those ``linked_temps``, each with its ``lstat``,
    last modified ``older_than_s`` seconds or more ago. Changes nothing; lists only what is
    provably kvtier's (see the module docstring): a seat that still has its temporary
    file's link is judged once that is gone."""
    if ns_dir.lstat(SEATS_DIR) is None:
        return []
    cutoff = (time.time_ns() if now_ns is None else now_ns) - older_than_s * 1e9  # never overflows
    found = []
    with ns_dir.subdir(SEATS_DIR) as seats:
        linked = linked_temps(seats)
        for name in seats.names():
            info = seats.lstat(name)
            if not _mine(info) or info.st_mtime_ns > cutoff:
                continue
            if name in linked or (info.st_nlink == 1 and (TEMP_NAME.fullmatch(name) or (
                    seat_number(name) is not None
                    and not _has_segment(ns_dir, _holder(seats, name))))):
                found.append((name, info))
    return found


def free_orphan_seats(ns_dir: SafeDir, older_than_s: float, dry_run: bool = False) -> list[str]:
    """Give back what ``orphan_seats`` finds (each only if it is still the file that was
    judged), or with ``dry_run`` only list it; return the names."""
    orphans = orphan_seats(ns_dir, older_than_s)
    if dry_run or not orphans:
        return [name for name, _ in orphans]
    freed = []
    with ns_dir.subdir(SEATS_DIR) as seats:
        linked = linked_temps(seats)
        for name, info in orphans:
            now = seats.lstat(name)
            if now is None or (now.st_ino, now.st_mtime_ns) != (info.st_ino, info.st_mtime_ns):
                continue  # freed and taken again since
            try:
                removed = seats.remove_file(name) if name in linked else remove_own_file(seats, name)
            except OSError:
                continue  # not a regular file of ours with one link any more: left alone
            if removed:
                freed.append(name)
    return freed
