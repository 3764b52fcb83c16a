"""What the offline commands read and change in one writer's segment: whether it is in use,
its index entries, the lock an operation that changes it holds, and freeing its slots.

A segment is in use when a process holds its ``lock`` (``flock``: decisive on this machine),
or when its lease names another machine and was written recently by this machine's clock
(``held_elsewhere``): ``flock`` is not seen across machines on every shared filesystem, so a
writer elsewhere is assumed alive until its lease is that old.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import time

from kvtier.io.cachedir import lock_namespace
from kvtier.io.format import HEADER_BYTES, INDEX_ENTRY_BYTES, HeaderError, SlotHeader, decode_header
from kvtier.io.index_file import MAX_SLOTS, SlotLayout, valid_header, written_index_entries
from kvtier.io.lease import held_elsewhere, read_lease
from kvtier.io.names import INDEX_FILE, LOG_FILE
from kvtier.io.safefs import CacheDirError, SafeDir, read_at
from kvtier.io.seats import held_here as lock_held
from kvtier.io.segment_log import SegmentLog
from kvtier.ops.cache import NamespaceDir, Segment, slot_file_sizes, slot_files

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)

def busy_reason(directory: SafeDir) -> str:
    """Why the segment open in ``directory`` is in use ("" when it is not)."""
    if lock_held(directory):
        return "a running kvtier process holds its lock"
    return held_elsewhere(read_lease(directory))


def in_use(segment: Segment) -> bool:
    """True when the segment is in use (see the module docstring); an unsafe one is not."""
    if segment.unsafe:
        return False
    try:
        with segment.open() as directory:
            return bool(busy_reason(directory))
    except OSError:
        return False


def gone_for(segment: Segment, now_ns: int | None = None) -> float | None:
    """Seconds since the segment's writer last showed life, by this machine's clock: its
    lease's last write (the segment directory's change time when it has no lease); None
    while it is in use (``in_use``: its lock held here, or a recent lease of another host)."""
    if in_use(segment):
        return None
    with segment.open() as handle:
        lease = read_lease(handle)
        since = lease.written_ns if lease is not None else os.fstat(handle.fd).st_ctime_ns
    return max(0.0, ((time.time_ns() if now_ns is None else now_ns) - since) / 1e9)


def top_lock_held(ns: NamespaceDir) -> bool:
    """True when a process holds a lock file directly in the namespace directory (the layout
    of another format version)."""
    if ns.unsafe:
        return False
    try:
        with ns.open() as directory:
            return lock_held(directory)
    except OSError:
        return False


def namespace_in_use(ns: NamespaceDir) -> bool:
    """True when ``top_lock_held(ns)`` or any segment of ``ns`` is in use."""
    return top_lock_held(ns) or any(in_use(segment) for segment in ns.segments)


def hold(directory: SafeDir) -> int:
    """Take the lock of the segment (or old-layout namespace) open in ``directory`` for an
    operation that changes it; raise ``CacheDirError`` (EBUSY) when it is in use."""
    remote = held_elsewhere(read_lease(directory))
    if remote:
        raise CacheDirError(errno.EBUSY, f"{directory.path} is in use: {remote}; stop it first")
    return lock_namespace(directory, "stop it first")


def proven_by_slots(directory: SafeDir, digest: bytes) -> bool:
    """True when a slot file in ``directory`` starts with a checked header of ``digest``."""
    for name in slot_files(directory).values():
        try:
            fd = directory.open_file(name, os.O_RDONLY)
        except OSError:
            continue
        try:
            header = decode_header(read_at(fd, HEADER_BYTES, 0))
        except (HeaderError, OSError):
            continue
        finally:
            os.close(fd)
        if header.namespace == digest:
            return True
    return False


def is_proven(ns: NamespaceDir) -> bool:
    """True when kvtier provably wrote this namespace: trusted metadata, or a slot (in the
    namespace directory or in a safe segment) whose checked header names it."""
    if ns.meta is not None:
        return True
    if ns.unsafe:
        return False
    digest = bytes.fromhex(ns.id)
    with ns.open() as directory:
        if proven_by_slots(directory, digest):
            return True
    for segment in ns.segments:
        if segment.unsafe:
            continue
        try:
            with segment.open() as directory:
                if proven_by_slots(directory, digest):
                    return True
        except OSError:
            continue
    return False


def _index_slots(segment: Segment, sizes: dict[int, int]) -> int:
    """Slots the index is read for: no further than the slot files go."""
    return min(MAX_SLOTS, (max(sizes) + 1) * segment.meta.file_slots if sizes else 0)


def index_entries(segment: Segment, directory: SafeDir,
                  sizes: dict[int, int]) -> list[tuple[int, SlotHeader | None]]:
    """(slot, header, or None when the entry is bad or names a slot past the end of the
    files) for every non-blank entry of the segment's index file, read no further than the
    files (``sizes``: ``slot_file_sizes``)."""
    meta = segment.meta
    stride, per_file = meta.stride, meta.file_slots
    slots = _index_slots(segment, sizes)
    layout = SlotLayout(meta.raw_bytes, 1, slots * stride)
    entries = []
    for slot, entry in written_index_entries(directory, slots):
        present = sizes.get(slot // per_file, 0) >= (slot % per_file + 1) * stride
        entries.append((slot, valid_header(entry, segment.digest, layout) if present else None))
    return entries


def free_slots(segment: Segment, slots: list[int]) -> None:
    """Blank the slots' index entries and headers, punch their space out of the files, and
    start the segment's log afresh (readers following it forget the slots)."""
    stride, per_file = segment.meta.stride, segment.meta.file_slots
    with segment.open() as handle:
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
            rewrite_log(segment, handle, slot_file_sizes(segment.meta, handle))
        finally:
            os.close(lock)


def rewrite_log(segment: Segment, directory: SafeDir, sizes: dict[int, int]) -> None:
    """Start the segment's ``log.kvt`` afresh from its index (a new file with a new epoch),
    after the index was changed, so that readers following the log forget what was freed.
    Only a log that is a regular file of this user is rewritten (anything else there is not
    kvtier's, and is left alone); the caller holds the segment's lock."""
    try:
        os.close(directory.open_file(LOG_FILE, os.O_RDONLY))
    except OSError:
        return
    kept = list(written_index_entries(directory, _index_slots(segment, sizes)))
    SegmentLog(directory, segment.digest, lambda: kept, rotate_after=MAX_SLOTS).close()
