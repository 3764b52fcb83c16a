"""One writer's segment of a namespace on one disk path: safe to open, locked, leased, and
its slot files.

Layout (``kvtier.segment.names``): ``<disk_path>/<namespace id>/namespace.json`` (what the
namespace is, for the CLI) and ``writers/<writer id>/`` (mode 0700), the segment, holding
``lock`` (held with ``flock`` by the process writing it), ``lease`` (its heartbeat, for
readers on other machines), ``slots-NNNN.kvt`` files (mode 0600) of fixed-size slots,
``index.kvt`` (a copy of each slot's header, 128 bytes per slot, written after the slot, so
that start-up reads one small file instead of every slot's header; synced after the slot
files by a flush and a clean close: ``sync``) and ``log.kvt`` (the same
entries appended, for readers that follow the segment). The slot's own header stays the
truth: every read checks it. Every entry is opened through :mod:`kvtier.io.safefs`. Files
grow in large preallocated steps, never past the capacity, and never below the
filesystem's free-space floor (``kvtier.segment.slot_files``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
from collections.abc import Iterable
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path

import numpy as np

from kvtier.config.settings import DiskFloor
from kvtier.io.buffers import PAGE
from kvtier.io.format import INDEX_ENTRY_BYTES, removed_entries, written_rows
from kvtier.io.safefs import CacheDirError, SafeDir, read_at, write_all
from kvtier.segment.holds import Holds
from kvtier.segment.lease import Lease
from kvtier.segment.lease_age import remote_holder
from kvtier.segment.lock import keep, let_go, lock_namespace
from kvtier.segment.log import Entries
from kvtier.segment.log_writer import SegmentLog
from kvtier.segment.names import (
    INDEX_FILE,
    LOCK_FILE,
    META_FILE,
    SEGMENT_LISTED,
    SLOT_FILE,
    TEMP_NAME,
    WRITERS_DIR,
    slot_number,
)
from kvtier.segment.o_direct import probe_o_direct
from kvtier.segment.seats import check_seated, still_seated
from kvtier.segment.segment_open import MAX_META_BYTES, OWN_ID_HINT, open_segment
from kvtier.segment.slot_files import grow_file, sync_segment, trim_slot_files
from kvtier.segment.slot_locks import SlotLocks

__all__ = ["INDEX_FILE", "LOCK_FILE", "MAX_META_BYTES", "META_FILE", "CacheDir", "CacheDirError", "SafeDir"]

log = logging.getLogger(__name__)

class CacheDir:
    """The slot files of one writer's segment of a namespace on one disk path, opened,
    locked and leased.

    ``stride`` bytes per slot, ``file_slots`` slots per file, ``num_slots`` in all. Every
    file is opened through :class:`SafeDir` (no symlink followed, regular files of this user
    only). Raises :class:`CacheDirError` when the path is unsafe or another process holds the
    segment; nothing stays open or locked then. ``write_index`` keeps both the dense index
    and the log that other readers follow; ``lease.beat()`` is the owner's heartbeat.
    """

    def __init__(self, root: Path, namespace_id: str, meta: dict, *, writer: str,
                 num_slots: int, stride: int, file_slots: int, o_direct: bool | None,
                 floor: DiskFloor, share_writers: int = 1,
                 lease_timeout: float = 120.0) -> None:
        self.path = root / namespace_id / WRITERS_DIR / writer
        self.writer = writer
        self._fds: dict[int, int] = {}
        self.index_fd = self._lock_fd = -1
        self.slot_locks = SlotLocks()  # a write into slots against a checked blank of one
        self._holds = Holds(str(self.path), self._release)
        self.log: SegmentLog | None = None
        self.lease: Lease | None = None
        self.dir = open_segment(root, namespace_id, writer, meta, share_writers)
        try:  # anything failing from here on must not keep the segment locked
            self._lock_fd = keep(lock_namespace(self.dir, OWN_ID_HINT))
            check_seated(root, namespace_id, writer, share_writers, self.dir)
            self._check_lease()
            self._remove_leftovers()
            self.lease = Lease(self.dir, writer, lease_timeout,
                               seated=partial(still_seated, root, namespace_id, writer, share_writers),
                               held=self.held)
            self.lease.beat()
            probed = probe_o_direct(self.dir)
            if o_direct and not probed:
                raise CacheDirError(errno.EINVAL, f"O_DIRECT does not work in {self.path}; set "
                                    "o_direct to auto or false")
            self.o_direct = probed if o_direct is None else o_direct
            self.num_slots, self.stride, self.file_slots = num_slots, stride, file_slots
            self.floor = floor
            self._sizes: dict[int, int] = {}
            self._grow_lock = threading.Lock()
            self.index_fd = self.dir.open_file(INDEX_FILE, os.O_RDWR, create=True)
            self._trim_extra_files()
            self.log = SegmentLog(self.dir, bytes.fromhex(namespace_id), self._index_snapshot,
                                  rotate_after=max(4096, 2 * num_slots))
        except BaseException:
            self.close()
            raise

    def _check_lease(self) -> None:
        """``CacheDirError`` (EBUSY) when the segment's lease shows a live writer on another
        machine (``remote_holder``: by the lease's age on the filesystem's clock): the lock
        just taken says nothing about one where ``flock`` is not passed on between machines."""
        elsewhere = remote_holder(self.dir)
        if elsewhere:
            raise CacheDirError(errno.EBUSY, f"{self.path} is in use on another machine: "
                                f"{elsewhere}; give each engine its own instance_id")

    def _remove_leftovers(self) -> None:
        """Remove the temporary and probe files a writer of this segment killed midway left
        (their exact names only; anything else is not kvtier's and stays)."""
        for name in self.dir.listed(SEGMENT_LISTED):
            if TEMP_NAME.fullmatch(name):
                with contextlib.suppress(OSError):  # not a regular file of ours: left alone
                    self.dir.remove_file(name)

    def _index_snapshot(self) -> Entries:
        """(local slots, entries) of every non-blank entry of the dense index."""
        data = self.read_index()
        rows = np.frombuffer(data, np.uint8, len(data) // INDEX_ENTRY_BYTES * INDEX_ENTRY_BYTES)
        rows = rows.reshape(-1, INDEX_ENTRY_BYTES)
        written = written_rows(rows)
        return written.astype(np.uint64), rows[written]

    @property
    def closed(self) -> bool:
        return self._holds.closed

    def held(self) -> AbstractContextManager[None]:
        """Around each use of the directory's descriptors (``fd``'s, the index's), from
        fetching one to its last system call: they stay open until the block ends whatever
        closes the directory meanwhile, so that a number never goes to a file opened later;
        ``OSError`` (EBADF) once closed."""
        return self._holds.held()

    @property
    def inode(self) -> int:
        return self.dir.inode()

    def slots_in_file(self, number: int) -> int:
        return max(0, min(self.file_slots, self.num_slots - number * self.file_slots))

    def _trim_extra_files(self) -> None:
        """Check every slot file, and cut them down to the current capacity (after
        disk_capacity shrank); a slot file that is not a regular file of ours is refused."""
        trim_slot_files(self.dir, lambda number: self.slots_in_file(number) * self.stride)
        if os.fstat(self.index_fd).st_size > self.num_slots * INDEX_ENTRY_BYTES:
            os.ftruncate(self.index_fd, self.num_slots * INDEX_ENTRY_BYTES)

    def slot_file_numbers(self) -> list[int]:
        """Numbers of the slot files there are, within the capacity."""
        with self._holds.held():
            numbers = [slot_number(name) for name in self.dir.listed(SEGMENT_LISTED)]
        return sorted(n for n in numbers if n is not None and self.slots_in_file(n))

    def write_index(self, local_slot: int, entry: np.ndarray) -> None:
        """Record a slot's header prefix (``INDEX_ENTRY_BYTES``) in the index file and the log
        (blank, zeros or a tombstone: the slot was emptied)."""
        prefix = entry[:INDEX_ENTRY_BYTES].data
        with self._holds.held():
            os.pwrite(self.index_fd, prefix, local_slot * INDEX_ENTRY_BYTES)
            if self.log is None:
                raise OSError(errno.EBADF, f"{self.path} has no log open")
            self.log.append(local_slot, prefix)

    def blank_index(self, local_slot: int, count: int) -> None:
        """Blank the index entries of ``count`` slots from ``local_slot``, as tombstones
        (``removed_entries``; the log hears of the slots when they are written)."""
        at, size = local_slot * INDEX_ENTRY_BYTES, count * INDEX_ENTRY_BYTES
        with self._holds.held():
            write_all(self.index_fd, removed_entries(read_at(self.index_fd, size, at), count), at)

    def replace_index(self, entries: Iterable[tuple[int, bytes]]) -> None:
        """Make the index hold exactly ``entries`` (local slot, entry; taken one at a time,
        so a generator keeps one entry in memory), atomically: written
        to a temporary file, synced, then renamed over the index; the log starts again from
        it. A crash or a full disk midway leaves the index as it was."""
        with self._holds.held():
            self._replace_index(entries)

    def _replace_index(self, entries: Iterable[tuple[int, bytes]]) -> None:
        temp = f".{INDEX_FILE}.tmp-{os.getpid()}-{secrets.token_hex(4)}"  # a ``TEMP_NAME``
        fd = self.dir.open_file(temp, os.O_RDWR | os.O_EXCL, create=True)
        try:
            for local_slot, entry in entries:
                write_all(fd, entry[:INDEX_ENTRY_BYTES], local_slot * INDEX_ENTRY_BYTES)
            os.fsync(fd)
            os.rename(temp, INDEX_FILE, src_dir_fd=self.dir.fd, dst_dir_fd=self.dir.fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                self.dir.remove_file(temp)
            raise
        old, self.index_fd = self.index_fd, fd
        with contextlib.suppress(OSError):  # (closed all the same: NFS may report a write-back)
            os.close(old)
        if self.log is not None:
            self.log.restart()

    def sync(self) -> None:
        """Make the slot files, then the index, durable (``sync_segment``); ``OSError``."""
        with self._holds.held():
            with self._grow_lock:  # (an I/O thread may open a slot file meanwhile)
                fds = list(self._fds.values())
            sync_segment(fds, self.index_fd, self.dir.fd)

    def read_index(self) -> bytes:
        """The index file (empty when it was never written), at most one entry per slot."""
        with self._holds.held():
            size = min(os.fstat(self.index_fd).st_size, self.num_slots * INDEX_ENTRY_BYTES)
            return read_at(self.index_fd, size, 0)

    def locate(self, local_slot: int) -> tuple[int, int]:
        """(file number, byte offset) of a slot of this directory."""
        return divmod(local_slot, self.file_slots)[0], (local_slot % self.file_slots) * self.stride

    def fd(self, number: int) -> int:
        """The open descriptor of slot file ``number`` (created empty when missing); EBADF
        once closed (a request that outlived its path's take-down must not reopen files)."""
        fd = self._fds.get(number)
        if fd is None:
            with self._grow_lock:
                fd = self._fds.get(number)
                if self.closed:
                    raise OSError(errno.EBADF, f"{self.path} was closed")
                if fd is None:
                    flags = os.O_RDWR | (os.O_DIRECT if self.o_direct else 0)
                    fd = self.dir.open_file(SLOT_FILE.format(number), flags, create=True)
                    self._sizes[number] = os.fstat(fd).st_size
                    self._fds[number] = fd
        return fd
    def file_size(self, number: int) -> int:
        with self._holds.held():
            self.fd(number)
            return self._sizes[number]

    def ensure_allocated(self, number: int, end: int) -> bool:
        """Make file ``number`` at least ``end`` bytes, preallocated; False below the floor."""
        if self._sizes.get(number, 0) >= end:
            return True
        with self._holds.held():
            fd = self.fd(number)
            with self._grow_lock:
                size = self._sizes[number]
                if size >= end:
                    return True
                grown = grow_file(fd, size, end, self.slots_in_file(number) * self.stride,
                                  self.floor, self.dir.fd)
                if grown is None:
                    return False
                self._sizes[number] = grown
                return True

    def close(self, lease: bool = True) -> None:
        """Let the segment go: with ``lease``, the lease says it was closed, and the lock is
        released, at once (a path coming back reopens it while a request on these files may
        still run); the files are closed once the last ``held`` block ends."""
        if lease and not self.closed and self.lease is not None:
            self.lease.close()
        if self._lock_fd >= 0:
            let_go(self._lock_fd)
            self._lock_fd = -1
        self._holds.close()

    def _release(self) -> None:
        """Close every file, each whatever the others' close said (a network filesystem's
        close may report a failed write-back), never raising: it may run on an I/O thread."""
        closes = [self.log.close] if self.log is not None else []
        closes += [partial(os.close, fd) for fd in self._fds.values()]
        closes += [partial(os.close, self.index_fd)] if self.index_fd >= 0 else []
        self._fds.clear()
        self.index_fd = -1
        for close in [*closes, self.dir.close]:
            try:
                close()
            except OSError as exc:
                log.warning("kvtier: closing a file of %s failed: %s", self.path, exc)


def aligned_view(buffer: np.ndarray, length: int) -> np.ndarray:
    """The first ``length`` bytes of ``buffer`` rounded up to a page (for O_DIRECT)."""
    return buffer[: -(-length // PAGE) * PAGE]
