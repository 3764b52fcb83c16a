"""What the offline commands read and change in one writer's segment: whether it is in use,
its index entries, the lock an operation that changes it holds, and its log started afresh
(``kvtier.ops.slot_freeing`` frees its slots).

A segment is in use when a process holds its ``lock`` (``flock``: decisive on this machine),
or when its lease was written on another machine, not closed, and recently by the
filesystem's clock (``remote_holder``: the lease file's modification time against the time
of a file made now in its namespace's directory, ``kvtier.ops.clock``; never the time the
lease states, its writer's clock): ``flock`` is not seen
across machines on every shared filesystem, so a writer elsewhere is assumed alive until its
lease is that old. Before a command changes a segment whose lease another machine's writer
did not close, it also watches that lease for two of the writer's heartbeats
(``kvtier.ops.liveness``): one that changed meanwhile is a live writer's, whatever file times
say (where a filesystem's clients set them, by their own clocks).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from array import array
from collections.abc import Callable, Generator

import numpy as np

from kvtier.io.format import INDEX_ENTRY_BYTES, REMOVED, SlotHeader
from kvtier.io.safefs import CacheDirError, SafeDir, kind_of
from kvtier.ops.cache import NamespaceDir, Segment, error_text, slot_files
from kvtier.ops.clock import NamespaceClock
from kvtier.ops.liveness import LOOKS, changed_while_watched, note_lease
from kvtier.segment.index_file import MAX_SLOTS, SlotLayout, valid_header, written_index_entries
from kvtier.segment.lease import MAX_LEASE_BYTES, REMOTE_LEASE_S, read_lease
from kvtier.segment.lease_age import dated_here, remote_holder
from kvtier.segment.lock import held_here as lock_held
from kvtier.segment.lock import lock_namespace
from kvtier.segment.log_writer import SegmentLog
from kvtier.segment.names import INDEX_FILE, LEASE_FILE, LOCK_FILE, LOG_FILE

Clock = Callable[[], int | None]  # the filesystem's clock: the time now, or None when not known
LOG_BLOCK = 8192  # index entries a log started afresh looks up in ``without`` at a time


def busy_reason(directory: SafeDir, clock: Clock, watch: bool = False) -> str:
    """Why the segment open in ``directory`` is in use ("" when it is not); ``clock``: the
    filesystem's clock (``NamespaceClock``: read in the namespace's directory, never in the
    segment's), read when needed; ``watch``: as a change judges it, its lease watched as
    well (``changed_while_watched``)."""
    if lock_held(directory):
        return "a running kvtier process holds its lock"
    remote = remote_holder(directory, clock)
    return remote or (changed_while_watched(directory) if watch else "")


def in_use(segment: Segment, watch: bool = False) -> bool:
    """True when the segment is in use (see the module docstring; ``watch``: as
    ``busy_reason``); an unsafe one is not."""
    if segment.unsafe:
        return False
    try:
        with segment.open() as directory:
            return bool(busy_reason(directory, NamespaceClock(segment.ns), watch=watch))
    except OSError:
        return False


def note_leases(dirs: list[NamespaceDir]) -> None:
    """Start watching the lease of every segment of ``dirs`` that another machine's writer
    did not close (``note_lease``), afresh (what this process saw before counts no more): a
    command that may change many segments calls it first, and waits once for all."""
    LOOKS.forget()
    for directory in dirs:
        for segment in directory.segments:
            try:
                with segment.open() as handle:
                    note_lease(handle)
            except OSError:
                continue


def idle_for(segment: Segment, clock: Clock | None = None) -> float | None:
    """Seconds since the segment's writer last showed life, by the filesystem's clock: since
    its lease file was last written (the segment directory's change time when it has no
    lease), against ``clock`` (by default a ``NamespaceClock``), read first: in the namespace
    directory, so that reading it changes no time of the segment's, whether or not it is in
    use. Where that clock is not known (no file can be made: a full disk; or may be: a
    namespace not proven kvtier's), a lease of this machine is dated by the time it states,
    on this machine's clock; None for any other. A lease dated more than ``REMOTE_LEASE_S``
    ahead (a forged time) counts as idle for as long as it is ahead, within that as 0.
    ``OSError`` when the segment cannot be opened."""
    now = (NamespaceClock(segment.ns) if clock is None else clock)()
    with segment.open() as handle:
        lease = read_lease(handle)
        info = handle.lstat(LEASE_FILE) if lease is not None else None
        since = info.st_mtime_ns if info is not None else os.fstat(handle.fd).st_ctime_ns
    if now is None and lease is not None and dated_here(lease):
        now, since = time.time_ns(), lease.written_ns  # one clock: this machine's
    if now is None:
        return None
    age = (now - since) / 1e9
    return -age if age < -REMOTE_LEASE_S else max(0.0, age)


def gone_for(segment: Segment, clock: Clock | None = None) -> float | None:
    """``idle_for``; None while the segment is in use (``in_use``: its lock held here, or a
    recent lease of another host)."""
    if in_use(segment):
        return None
    return idle_for(segment, clock)


def file_problem(directory: SafeDir) -> str:
    """Why a file kvtier names in the segment open in ``directory`` (lock, lease, log, index,
    slot files) is not kvtier's ("" when every one present is: ``_entry_problem``)."""
    for name in (LOCK_FILE, LEASE_FILE, LOG_FILE, INDEX_FILE, *slot_files(directory).values()):
        problem = _entry_problem(directory, name)
        if problem:
            return problem
    return ""


def _entry_problem(directory: SafeDir, name: str) -> str | None:
    """None when ``name`` is missing; "" when it is a regular file of this user with one
    link (a lease no larger than kvtier writes one); else why it is not kvtier's."""
    info = directory.lstat(name)
    where = f"{directory.path}/{name}"
    if info is None:
        return None
    if not stat.S_ISREG(info.st_mode):
        return f"{where} is {kind_of(info.st_mode)}, not a regular file; kvtier never made it"
    try:
        if name == LEASE_FILE:
            directory.read_file(name, MAX_LEASE_BYTES)
        else:
            os.close(directory.open_file(name, os.O_RDONLY))
    except FileNotFoundError:
        return None  # gone since
    except OSError as exc:
        return error_text(exc, where)
    return ""


def segment_problem(segment: Segment) -> str:
    """Why ``segment`` is unsafe, as ``kvtier inspect`` says ("" when it is not): its
    directory (``Segment.problem``), or a file kvtier names in it (``file_problem``)."""
    if segment.unsafe:
        return segment.problem
    try:
        with segment.open() as directory:
            return file_problem(directory)
    except OSError as exc:
        return error_text(exc, str(segment.path))


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


def hold(directory: SafeDir, clock: Clock) -> int:
    """Take the lock of the segment (or old-layout namespace) open in ``directory`` for an
    operation that changes it; raise ``CacheDirError`` (EBUSY) when it is in use, its lease
    watched as well (``busy_reason`` with ``watch``; ``clock``: the namespace's)."""
    remote = remote_holder(directory, clock) or changed_while_watched(directory)
    if remote:
        raise CacheDirError(errno.EBUSY, f"{directory.path} is in use: {remote}; stop it first")
    return lock_namespace(directory, "stop it first")


def _index_slots(segment: Segment, sizes: dict[int, int]) -> int:
    """Slots the index is read for: no further than the slot files go, or, with none left,
    as far as the index goes (each entry then names a slot that is not there)."""
    return min(MAX_SLOTS, (max(sizes) + 1) * segment.meta.file_slots if sizes else MAX_SLOTS)


def index_entries(segment: Segment, directory: SafeDir,
                  sizes: dict[int, int]) -> Generator[tuple[int, SlotHeader | None], None, None]:
    """(slot, header, or None when the entry is bad or names a slot past the end of the
    files) for every non-blank entry of the segment's index file, in slot order, read no
    further than the files (``sizes``: ``slot_file_sizes``) and a MiB at a time: a caller
    that keeps only what it needs of each holds no more (the index stays open in
    ``directory`` until the iterator is done or closed)."""
    meta = segment.meta
    stride, per_file = meta.stride, meta.file_slots
    slots = _index_slots(segment, sizes)
    layout = SlotLayout(meta.raw_bytes, 1, slots * stride)
    for slot, entry in written_index_entries(directory, slots):
        present = sizes.get(slot // per_file, 0) >= (slot % per_file + 1) * stride
        yield slot, valid_header(entry, segment.digest, layout) if present else None


def index_tombstones(segment: Segment, directory: SafeDir, sizes: dict[int, int]) -> dict[int, bytes]:
    """The tombstones of the segment's index file by slot (``mark_removed``: chunks removed,
    their headers perhaps not blanked yet), read as ``index_entries`` reads the entries."""
    return dict(written_index_entries(directory, _index_slots(segment, sizes), REMOVED))


def rewrite_log(segment: Segment, directory: SafeDir, sizes: dict[int, int],
                without: np.ndarray | None = None) -> str:
    """Start the segment's ``log.kvt`` afresh from its index, less the slots ``without`` (a
    new file with a new epoch), so that readers following the log forget what is freed.
    What is kept is held as the log's records are (the slot and the index entry, 136 bytes
    a chunk), never as a Python object a chunk; ``without`` is looked up a block of entries
    at a time. Only a log that is a regular file of this user is rewritten: anything else
    there is not kvtier's and is left alone, and the answer says so ("" when the log was
    rewritten, or there is none). The caller holds the segment's lock."""
    problem = _entry_problem(directory, LOG_FILE)
    if problem is None:
        return ""
    if problem:
        return f"{problem}; so it was not started afresh"
    gone = np.unique(np.empty(0, np.int64) if without is None else without)  # sorted
    slots, entries = array("Q"), bytearray()
    block, rows = array("Q"), bytearray()

    def keep_block() -> None:
        found = np.frombuffer(block, dtype=np.uint64).astype(np.int64)
        at = np.minimum(np.searchsorted(gone, found), max(len(gone) - 1, 0))
        kept = (gone[at] != found) if len(gone) else np.ones(len(found), bool)
        slots.extend(found[kept].astype(np.uint64).tolist())
        entries.extend(np.frombuffer(rows, np.uint8).reshape(-1, INDEX_ENTRY_BYTES)[kept].tobytes())
        del block[:], rows[:]

    for slot, entry in written_index_entries(directory, _index_slots(segment, sizes)):
        block.append(slot)
        rows += entry
        if len(block) == LOG_BLOCK:
            keep_block()
    keep_block()
    snapshot = (np.frombuffer(slots, dtype=np.uint64),
                np.frombuffer(entries, dtype=np.uint8).reshape(-1, INDEX_ENTRY_BYTES))
    SegmentLog(directory, segment.digest, lambda: snapshot, rotate_after=MAX_SLOTS).close()
    return ""
