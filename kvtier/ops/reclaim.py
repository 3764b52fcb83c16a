"""``kvtier gc`` and ``kvtier clear``: give disk space back, never touching a namespace that a
running process holds, and deleting only what kvtier provably wrote: a namespace whose
metadata (or a slot header) names it, and in it only the files kvtier names, regular files of
this user. Anything else stays, and is reported."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import time
from dataclasses import dataclass, field

from kvtier.io.cachedir import INDEX_FILE, LOCK_FILE, META_FILE, SLOT_NAME
from kvtier.io.format import HEADER_BYTES, INDEX_ENTRY_BYTES
from kvtier.io.safefs import SafeDir
from kvtier.ops.cache import NamespaceDir, hold, in_use, index_entries, is_proven, slot_file_sizes, slot_files

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


@dataclass
class GcReport:
    chunks_freed: int = 0
    bytes_freed: int = 0  # payload bytes of the chunks freed
    namespaces_removed: list[str] = field(default_factory=list)
    skipped_in_use: list[str] = field(default_factory=list)
    skipped_unsafe: list[str] = field(default_factory=list)  # not provably kvtier's, or unsafe
    left: dict[str, list[str]] = field(default_factory=dict)  # entries kvtier did not write
    dry_run: bool = False

    @property
    def left_alone(self) -> bool:
        """True when something was not done: in use, unsafe or entries left behind."""
        return bool(self.skipped_in_use or self.skipped_unsafe or self.left)


@dataclass(frozen=True)
class _Chunk:
    directory: NamespaceDir
    slot: int
    created_ns: int
    stored_bytes: int


def gc(dirs: list[NamespaceDir], *, older_than_s: float | None = None,
       target_bytes: int | None = None, stale: bool = False, dry_run: bool = False) -> GcReport:
    """Free chunks older than ``older_than_s``, then the oldest until what is stored is at most
    ``target_bytes``; with ``stale``, remove namespaces of another format version, and those
    without metadata that a slot header proves kvtier's."""
    report = GcReport(dry_run=dry_run)
    chunks = []
    for directory in dirs:
        if directory.unsafe:
            report.skipped_unsafe.append(directory.id)
        elif in_use(directory):
            report.skipped_in_use.append(directory.id)
        elif stale and directory.status in ("stale", "orphaned"):
            _remove_stale(directory, report, dry_run)
        elif directory.readable:
            chunks += _chunks(directory, report)
    chunks.sort(key=lambda c: c.created_ns)
    for directory, mine in _victims(chunks, older_than_s, target_bytes).values():
        try:
            if not dry_run:
                _free(directory, [c.slot for c in mine])
        except OSError as exc:
            report.left[directory.id] = [exc.strerror or str(exc)]
            continue
        report.chunks_freed += len(mine)
        report.bytes_freed += sum(c.stored_bytes for c in mine)
    return report


def _chunks(directory: NamespaceDir, report: GcReport) -> list[_Chunk]:
    try:
        with directory.open() as handle:
            entries = index_entries(directory, handle, slot_file_sizes(directory, handle))
    except OSError:
        report.skipped_unsafe.append(directory.id)
        return []
    return [_Chunk(directory, slot, h.created_ns, h.payload_bytes)
            for slot, h in entries if h is not None]


def _victims(chunks: list[_Chunk], older_than_s: float | None,
             target_bytes: int | None) -> dict[str, tuple[NamespaceDir, list[_Chunk]]]:
    """The chunks to free (oldest first), by namespace."""
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
    by_dir: dict[str, tuple[NamespaceDir, list[_Chunk]]] = {}
    for chunk in victims:
        by_dir.setdefault(chunk.directory.id, (chunk.directory, []))[1].append(chunk)
    return by_dir


def _remove_stale(directory: NamespaceDir, report: GcReport, dry_run: bool) -> None:
    try:
        with directory.open() as handle:
            proven = is_proven(directory, handle)
    except OSError:
        proven = False
    if not proven:
        report.skipped_unsafe.append(directory.id)
    elif dry_run:
        report.namespaces_removed.append(directory.id)
    else:
        left = remove_namespace(directory)
        if left:
            report.left[directory.id] = left
        else:
            report.namespaces_removed.append(directory.id)


def _free(directory: NamespaceDir, slots: list[int]) -> None:
    """Blank the slots' index entries and headers, and punch their space out of the files."""
    meta = directory.readable_meta
    stride, per_file = meta.stride, meta.file_slots
    with directory.open() as handle:
        lock = hold(handle)
        try:
            index = handle.open_file(INDEX_FILE, os.O_RDWR)
            try:
                for slot in slots:
                    os.pwrite(index, bytes(INDEX_ENTRY_BYTES), slot * INDEX_ENTRY_BYTES)
            finally:
                os.close(index)
            names = slot_files(handle)
            for slot in slots:
                fd = handle.open_file(names[slot // per_file], os.O_RDWR)
                try:
                    offset = (slot % per_file) * stride
                    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                                       ctypes.c_long(offset), ctypes.c_long(stride)) != 0:
                        os.pwrite(fd, bytes(HEADER_BYTES), offset)  # no holes here: blank it
                finally:
                    os.close(fd)
        finally:
            os.close(lock)


def _written_by_kvtier(name: str) -> bool:
    return (name in (META_FILE, INDEX_FILE) or SLOT_NAME.fullmatch(name) is not None
            or name.startswith((".o_direct_probe", f".{META_FILE}.tmp-")))


def remove_namespace(directory: NamespaceDir) -> list[str]:
    """Remove what kvtier wrote in a namespace (it must not be in use), then the directory
    if nothing else is left in it; return the entries left (kvtier did not write them)."""
    with SafeDir.open(directory.root) as top:
        with top.subdir(directory.id) as handle:
            lock = hold(handle)
            try:
                left = []
                for name in handle.names():
                    if name == LOCK_FILE:
                        continue
                    try:
                        if not _written_by_kvtier(name) or not handle.remove_file(name):
                            left.append(name)
                    except OSError:  # not a regular file of ours: not kvtier's to delete
                        left.append(name)
                handle.remove_file(LOCK_FILE)  # held by us: nobody else is using it
            finally:
                os.close(lock)
        if not left and not top.remove_dir(directory.id):
            left.append("(entries made while it was being removed)")
    return left


def clear(dirs: list[NamespaceDir]) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """Remove whole namespaces that kvtier provably wrote; return (removed, skipped because in
    use, left alone with the reason or the entries kvtier did not write)."""
    removed, busy, left = [], [], {}
    for directory in dirs:
        try:
            with directory.open() as handle:
                proven = not directory.unsafe and is_proven(directory, handle)
            if not proven:
                left[directory.id] = [directory.problem or "not provably written by kvtier"]
                continue
            rest = remove_namespace(directory)
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                busy.append(directory.id)
            else:
                left[directory.id] = [exc.strerror or str(exc)]
            continue
        if rest:
            left[directory.id] = rest
        else:
            removed.append(directory.id)
    return removed, busy, left
