"""``kvtier gc`` and ``kvtier clear``: give disk space back, never touching a namespace that a
running process holds."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import time
from dataclasses import dataclass, field

from kvtier.io.cachedir import INDEX_FILE
from kvtier.io.format import HEADER_BYTES, INDEX_ENTRY_BYTES
from kvtier.ops.cache import NamespaceDir, hold, in_use, index_entries
from kvtier.ops.inspect import inspect_namespace

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


@dataclass
class GcReport:
    chunks_freed: int = 0
    bytes_freed: int = 0  # payload bytes of the chunks freed
    namespaces_removed: list[str] = field(default_factory=list)
    skipped_in_use: list[str] = field(default_factory=list)
    dry_run: bool = False


@dataclass(frozen=True)
class _Chunk:
    directory: NamespaceDir
    slot: int
    created_ns: int
    stored_bytes: int


def gc(dirs: list[NamespaceDir], *, older_than_s: float | None = None,
       target_bytes: int | None = None, stale: bool = False, dry_run: bool = False) -> GcReport:
    """Free chunks older than ``older_than_s``, then the oldest until what is stored is at most
    ``target_bytes``; with ``stale``, remove namespaces of another format or without metadata."""
    report = GcReport(dry_run=dry_run)
    usable = []
    for directory in dirs:
        if in_use(directory):
            report.skipped_in_use.append(directory.id)
        elif stale and inspect_namespace(directory).status != "ok":
            report.namespaces_removed.append(directory.id)
            if not dry_run:
                shutil.rmtree(directory.path)
        else:
            usable.append(directory)
    chunks = sorted((_Chunk(d, slot, h.created_ns, h.payload_bytes)
                     for d in usable for slot, h in index_entries(d) if h is not None),
                    key=lambda c: c.created_ns)
    victims = []
    if older_than_s is not None:
        cutoff = time.time_ns() - int(older_than_s * 1e9)
        victims = [c for c in chunks if c.created_ns < cutoff]
    if target_bytes is not None:
        kept = chunks[len(victims):]
        stored = sum(c.stored_bytes for c in kept)
        for chunk in kept:
            if stored <= target_bytes:
                break
            victims.append(chunk)
            stored -= chunk.stored_bytes
    for directory in {c.directory.path: c.directory for c in victims}.values():
        mine = [c for c in victims if c.directory.path == directory.path]
        if not dry_run:
            _free(directory, [c.slot for c in mine])
        report.chunks_freed += len(mine)
        report.bytes_freed += sum(c.stored_bytes for c in mine)
    return report


def _free(directory: NamespaceDir, slots: list[int]) -> None:
    """Blank the slots' index entries and headers, and punch their space out of the files."""
    lock = hold(directory)
    try:
        index = os.open(directory.path / INDEX_FILE, os.O_RDWR | os.O_NOFOLLOW)
        try:
            for slot in slots:
                os.pwrite(index, bytes(INDEX_ENTRY_BYTES), slot * INDEX_ENTRY_BYTES)
        finally:
            os.close(index)
        stride, per_file = directory.stride, directory.file_slots
        for slot in slots:
            path = directory.path / f"slots-{slot // per_file:04d}.kvt"
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                offset = (slot % per_file) * stride
                if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                                   ctypes.c_long(offset), ctypes.c_long(stride)) != 0:
                    os.pwrite(fd, bytes(HEADER_BYTES), offset)  # no holes here: blank it
            finally:
                os.close(fd)
    finally:
        os.close(lock)


def clear(dirs: list[NamespaceDir]) -> tuple[list[str], list[str]]:
    """Remove whole namespaces; return (removed, skipped because in use)."""
    removed, busy = [], []
    for directory in dirs:
        try:
            lock = hold(directory)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            busy.append(directory.id)
            continue
        try:
            shutil.rmtree(directory.path)
            removed.append(directory.id)
        finally:
            os.close(lock)
    return removed, busy
