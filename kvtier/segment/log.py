"""A writer's append-only index log, so that readers in other processes (other engines on a
shared directory) learn what its segment holds by reading only what was appended since they
last looked.

``log.kvt`` is a 64-byte file header (magic, version, record size, the namespace digest, a
random epoch, a checksum), then fixed-size records: a local slot number, the slot header's
first ``INDEX_ENTRY_BYTES`` as written into the slot (all zeros: the slot was emptied), and
a checksum of both. The writer appends one record after each slot write or blanking. When
the log grows past twice the segment's slots it is rewritten from the segment's dense index
(a new file with a new epoch, renamed over the old one); readers see the new inode or epoch
and read it from the start. The slot's own header stays the truth: a record only says where
to look, and every read checks what it finds.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.io.format import INDEX_ENTRY_BYTES, SlotHeader, is_blank
from kvtier.io.safefs import SafeDir, read_at
from kvtier.keys import ChunkKey
from kvtier.segment.index_file import MAX_SLOTS, SlotLayout, valid_header
from kvtier.segment.names import LOG_FILE

LOG_MAGIC = b"KVTLOG\x00\x00"
LOG_VERSION = 1
LOG_HEADER_BYTES = 64
_HEAD = struct.Struct("<8sHHI16sQ")
_RECORD = struct.Struct(f"<Q{INDEX_ENTRY_BYTES}s")
_SUM = struct.Struct("<Q")
RECORD_BYTES = _RECORD.size + _SUM.size
READ_PIECE = 4 * 1024**2  # the most bytes of log read per call
FIRST_PIECE = 64 * 1024  # a follower's first read; each read that checks out whole doubles it
REFRESH_BYTES = 8 * 1024**2  # the most bytes of log one refresh reads by default (58,254 records)

# (local slots, their entries as rows of INDEX_ENTRY_BYTES) of every written slot
Entries = tuple[np.ndarray, np.ndarray]
Snapshot = Callable[[], Entries]


def file_header(namespace: bytes, epoch: int) -> bytes:
    body = _HEAD.pack(LOG_MAGIC, LOG_VERSION, LOG_HEADER_BYTES, RECORD_BYTES, namespace, epoch)
    return (body + _SUM.pack(xxhash.xxh3_64_intdigest(body))).ljust(LOG_HEADER_BYTES, b"\0")


def _epoch_of(data: bytes, namespace: bytes) -> int | None:
    """The epoch of a log file header that checks out for ``namespace``, else None."""
    if len(data) < LOG_HEADER_BYTES:
        return None
    body = data[:_HEAD.size]
    magic, version, head_bytes, record_bytes, digest, epoch = _HEAD.unpack(body)
    (checksum,) = _SUM.unpack_from(data, _HEAD.size)
    if (magic != LOG_MAGIC or version != LOG_VERSION or head_bytes != LOG_HEADER_BYTES
            or record_bytes != RECORD_BYTES or digest != namespace
            or checksum != xxhash.xxh3_64_intdigest(body)):
        return None
    return epoch


def encode_record(local_slot: int, entry: bytes | memoryview) -> bytes:
    body = _RECORD.pack(local_slot, bytes(entry[:INDEX_ENTRY_BYTES]))
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def entries_of(pairs: Iterable[tuple[int, bytes | memoryview]]) -> Entries:
    """A snapshot's arrays from (local slot, entry) pairs."""
    pairs = list(pairs)
    entries = np.zeros((len(pairs), INDEX_ENTRY_BYTES), np.uint8)
    for row, (_, entry) in zip(entries, pairs, strict=True):
        row[:] = np.frombuffer(bytes(entry[:INDEX_ENTRY_BYTES]), np.uint8)
    return np.array([slot for slot, _ in pairs], np.uint64), entries


def encode_records(snapshot: Entries) -> bytes:
    """``encode_record`` of every (slot, entry) of a snapshot, at once (a million records
    in a fraction of a second; one by one, about two seconds)."""
    slots, entries = snapshot
    records = np.zeros((len(slots), RECORD_BYTES), np.uint8)
    records[:, :8] = slots.astype("<u8").view(np.uint8).reshape(-1, 8)
    records[:, 8:_RECORD.size] = entries
    digest = xxhash.xxh3_64_intdigest
    sums = np.fromiter(map(digest, records[:, :_RECORD.size]), "<u8", count=len(slots))
    records[:, _RECORD.size:] = sums.view(np.uint8).reshape(-1, 8)
    return records.tobytes()


@dataclass(frozen=True)
class LogChange:
    """A slot of the followed segment that changed: what it holds now (None: nothing) and
    the key it held before (None: nothing, or forgotten by a reset)."""

    slot: int
    header: SlotHeader | None
    previous: ChunkKey | None = None


class LogFollower:
    """A reader's side: follows one writer's log in ``directory`` (the writer's segment).

    Contract: ``refresh(budget)`` reads at most ``budget`` bytes appended since the last call
    (``behind``: more was there) and returns the slots that changed, each once, with what
    it holds now; after a rotation, or when the log is gone or unreadable, ``reset`` is
    True: what was known before is ``forgotten()`` (slot to key, once) and ``slots`` is
    rebuilt from the new file. ``slots`` maps each local slot to the key its latest record
    names (entries that are not valid headers of this namespace and chunk size count as
    emptied slots, and in ``bad``). A record that does not check out stops the reading
    there (it may be half written); when it still does after ``_STUCK_LIMIT`` refreshes with
    records after it, it is skipped and counted in ``bad``. A refresh costs what was
    appended since the last: from a record that stopped the reading, the log is read again
    one record at a time (a log of zeros costs a record or two a refresh, not its size).
    Memory is bounded: a record naming a slot at or past ``max_slots`` counts in ``bad``,
    and ``refresh(room=n)`` keeps at most ``n`` slots known (records of further slots are
    passed over, their chunks unknown, and counted in ``over``). Never raises for what the
    files hold; an ``OSError`` opening or reading the segment's files propagates, and
    every key the caller may know of and ``slots`` no longer names (dropped by a reset
    before it, replaced by records read before it) is then in ``forgotten()``: a caller
    that lets the writer go drops ``slots`` and ``forgotten()``."""

    _STUCK_LIMIT = 3

    def __init__(self, directory: SafeDir, namespace: bytes, raw_bytes: int,
                 max_slots: int = MAX_SLOTS) -> None:
        self._dir, self._namespace = directory, namespace
        self._layout = SlotLayout(raw_bytes, 1, 0)
        self._max_slots = min(max_slots, MAX_SLOTS)
        self._room = self._max_slots
        self._fd = -1
        self._inode = self._epoch = 0
        self._offset = LOG_HEADER_BYTES
        self._piece = FIRST_PIECE
        self._stuck = 0
        self.slots: dict[int, ChunkKey] = {}
        self._forgotten: dict[int, ChunkKey] = {}  # what the last reset dropped
        self.behind = False
        self.bad = 0
        self.over = 0
        self.bytes_read = 0

    def refresh(self, budget: int = REFRESH_BYTES,
                room: int | None = None) -> tuple[bool, list[LogChange]]:
        """(reset, changes) since the last call; see the class docstring."""
        self._room = self._max_slots if room is None else room
        reset = self._reopen_if_new()
        self.behind = False
        if self._fd < 0:
            return reset, []
        changed: dict[int, tuple[ChunkKey | None, SlotHeader | None]] = {}
        try:
            self._read(budget, changed)
        except OSError:  # ``slots`` has changes the caller never gets: what they replaced
            for slot, (old, _) in changed.items():  # is handed over with what a reset drops
                if old is not None:
                    self._forgotten.setdefault(slot, old)
            raise
        return reset, [LogChange(slot, new, old) for slot, (old, new) in changed.items()]

    def _read(self, budget: int, changed: dict[int, tuple[ChunkKey | None, SlotHeader | None]]) -> None:
        """Read and apply at most ``budget`` bytes of records appended, noting each slot
        changed in ``changed`` (its key before this refresh, its header now)."""
        size = os.fstat(self._fd).st_size
        while self._offset + RECORD_BYTES <= size:
            want = min(size - self._offset, self._piece, budget) // RECORD_BYTES * RECORD_BYTES
            if want <= 0:
                self.behind = True  # the budget is spent: the rest waits for the next call
                break
            data = read_at(self._fd, want, self._offset)
            self.bytes_read += len(data)
            budget -= len(data)
            used = self._apply(data, size, changed)
            if used < len(data):  # a record that does not check out: alone next time
                self._piece = RECORD_BYTES
                break
            self._piece = min(READ_PIECE, 2 * self._piece)
            if len(data) < want:  # the file is shorter than it was: cut meanwhile
                break

    def _apply(self, data: bytes, size: int,
               changed: dict[int, tuple[ChunkKey | None, SlotHeader | None]]) -> int:
        """Apply the whole records of ``data`` (read at the current offset); the bytes used."""
        used = 0
        for start in range(0, len(data) - RECORD_BYTES + 1, RECORD_BYTES):
            record = data[start:start + RECORD_BYTES]
            (checksum,) = _SUM.unpack_from(record, _RECORD.size)
            if checksum != xxhash.xxh3_64_intdigest(record[:_RECORD.size]):
                more = self._offset + RECORD_BYTES < size
                self._stuck += 1
                if not more or self._stuck < self._STUCK_LIMIT:
                    return used
                self.bad += 1  # damaged for good: step over it
            else:
                slot, entry = _RECORD.unpack_from(record)
                old = changed[slot][0] if slot in changed else self.slots.get(slot)
                changed[slot] = (old, self._note(slot, entry))
            self._stuck = 0
            self._offset += RECORD_BYTES
            used += RECORD_BYTES
        return used

    def _note(self, slot: int, entry: bytes) -> SlotHeader | None:
        header = None if is_blank(entry) else valid_header(entry, self._namespace, self._layout)
        if header is not None and slot >= self._max_slots:
            header = None  # past what a segment holds: junk, as an invalid header is
        if header is None and not is_blank(entry):
            self.bad += 1
        if header is None:
            self.slots.pop(slot, None)
            return None
        if slot not in self.slots and len(self.slots) >= self._room:
            self.over += 1
            return None
        self.slots[slot] = header.key
        return header

    def _reopen_if_new(self) -> bool:
        """Open the log when it is not the file (inode and epoch) followed so far; True when
        what was known of the writer must be forgotten."""
        info = self._dir.lstat(LOG_FILE)
        if info is not None and self._fd >= 0 and info.st_ino == self._inode:
            head = read_at(self._fd, LOG_HEADER_BYTES, 0)
            if _epoch_of(head, self._namespace) == self._epoch:
                return False
        had = self._fd >= 0 or bool(self.slots)
        self.close()
        self._forgotten, self.slots = self.slots, {}
        self._offset, self._stuck, self._piece = LOG_HEADER_BYTES, 0, FIRST_PIECE
        if info is None:
            return had
        fd = self._dir.open_file(LOG_FILE, os.O_RDONLY)
        try:
            epoch = _epoch_of(read_at(fd, LOG_HEADER_BYTES, 0), self._namespace)
            inode = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        if epoch is None:
            os.close(fd)
            self.bad += 1
            return had
        self._fd, self._inode, self._epoch = fd, inode, epoch
        return True

    def forgotten(self) -> dict[int, ChunkKey]:
        """What the last reset dropped (slot to key), handed over once: kept no longer."""
        dropped, self._forgotten = self._forgotten, {}
        return dropped

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
