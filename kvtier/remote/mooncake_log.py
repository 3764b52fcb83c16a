"""The log of token records (``RemoteTier.append_records``/``read_records``) on Mooncake
Store, whose client has no append, no counter and no listing of keys.

The log is a run of batch objects ``<name>:<seq>`` (seq 1, 2, ...), each up to ``ENTRIES``
records and ``BATCH_BYTES``, and a head hint ``<name>:head``: the last seq written.

- **Claiming a seq.** A put never replaces a value the store holds, but answers 0 either
  way (verified on the store: three writers racing on the same keys all hear 0, each key
  keeps the first value). So a writer puts its batch, which carries a nonce of its own, at
  the seq after the head (or after its own last seq, if higher) and reads it back: the value
  there is its own, or another writer took that seq and it asks which of the ``PROBE``
  seqs after it the store holds (one round trip, however far the head lags: every upsert
  of the head lags, some fail) and puts the batch past the last one held (``TRIES`` tries);
  a free seq below it is left free, since a reader may have passed it. A head being
  upserted (``NOT_READY``), or whose read failed otherwise, is read again, up to
  ``HEAD_TRIES`` times: unknown still, the writer goes on from its own last seq while the store still
  holds that batch, and puts nothing otherwise (a seq past one long removed is behind every
  reader): the append fails. Then it upserts
  the head and removes seq - ``KEEP``: the log keeps its last ``KEEP`` batches, up to
  ``RECORD_LOG`` entries (fewer when appends are small).
- **Reading.** The batches after the cursor, ``WINDOW`` a get, ``ROUNDS`` gets at most. A
  batch missing at or below the head was removed or evicted: passed over; one missing
  past it ends the log for now, and so does one still being put (``NOT_READY``; verified:
  a get of a value whose put has not ended answers it) or any other code (a transfer
  failed, INVALID_PARAMS: read again next time; at or below the head for ``STALLED_S`` at
  most, then passed over), unless the store reports the value's size larger than a batch
  can be (``TOO_LARGE``). A reader
  that starts (``b"0"``) or fell behind the batches kept starts at the oldest one kept.
  A head still being upserted after ``HEAD_TRIES`` reads is taken as none.
  The cursor names the last batch read (``b"<seq>"``) or how far into it (``b"<seq>.<n>"``).
- **Trust.** Values are parsed with bounds (magic, version, count, lengths, the seq of the
  key); one that does not parse, or is too large to be a batch, is passed over, never raised.

An append costs four round trips (head, put, read back, head and removal in two) and
three more for each seq lost (probe, put, read back), a read two (head, batches) per
``WINDOW``; all in one call given to ``ask``, watched as a whole.
Eviction by the store loses only hints.
"""

from __future__ import annotations

import os
import re
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import numpy as np

from kvtier.keys import ChunkKey
from kvtier.remote.base import RECORD_LOG
from kvtier.remote.mooncake_client import GONE, STORED
from kvtier.remote.mooncake_trip import TOO_LARGE, Trip

ENTRIES = 64  # records a batch holds at most
BATCH_BYTES = 128 * 1024  # a batch's bytes at most (64 records of 256 tokens take 72 KiB)
KEEP = RECORD_LOG // ENTRIES  # batches kept
WINDOW = 16  # batches a get reads
ROUNDS = 4  # gets a read makes at most
TRIES = 8  # seqs a batch is put at before its append fails
PROBE = 16  # seqs a lost claim asks the store about at once
HEAD_TRIES, HEAD_WAIT_S = 6, 0.0005  # reads of a head being upserted, the wait growing by this
NOT_READY = -703  # a value still being put
MISSING = GONE - {NOT_READY}  # a value removed or evicted (or not yet put)
STALLED_S = 30.0  # a batch at or below the head unread this long (being put, failing) is passed over
HEAD_READ = 64  # bytes read of the head hint (a larger value is no hint)
MAX_SEQ = 10**18 - 1  # a head naming more is no hint (a cursor names up to 18 digits)

_BATCH = struct.Struct("<4sBBHQ8s")  # magic, version, 0, count, seq, nonce
_ENTRY = struct.Struct("<HI")  # key length, record length
_HEAD = struct.Struct("<4sB3xQ")  # magic, version, seq
BATCH_MAGIC, HEAD_MAGIC, VERSION = b"KVRL", b"KVRH", 1
_CURSOR = re.compile(rb"([0-9]{1,18})(?:\.([0-9]{1,5}))?")

Entry = tuple[bytes, bytes]


def split(items: Sequence[tuple[ChunkKey, bytes]]) -> tuple[list[list[Entry]], int]:
    """``items`` in batches of up to ``ENTRIES`` and ``BATCH_BYTES``, in order, and the
    count of those too large for any batch (left out)."""
    batches: list[list[Entry]] = []
    size, dropped = _BATCH.size, 0
    for key, record in items:
        entry = (bytes(key), bytes(record))
        need = _ENTRY.size + len(entry[0]) + len(entry[1])
        if _BATCH.size + need > BATCH_BYTES or len(entry[0]) > 0xFFFF:
            dropped += 1
            continue
        if not batches or len(batches[-1]) >= ENTRIES or size + need > BATCH_BYTES:
            batches.append([])
            size = _BATCH.size
        batches[-1].append(entry)
        size += need
    return batches, dropped


def pack_batch(seq: int, entries: Sequence[Entry], nonce: bytes | None = None) -> bytes:
    parts = [_BATCH.pack(BATCH_MAGIC, VERSION, 0, len(entries), seq, nonce or os.urandom(8))]
    for key, record in entries:
        parts += [_ENTRY.pack(len(key), len(record)), key, record]
    return b"".join(parts)


def unpack_batch(value: bytes, seq: int) -> list[Entry] | None:
    """The entries of batch ``seq``'s value; None for a value that is no such batch."""
    if not isinstance(value, bytes) or not _BATCH.size <= len(value) <= BATCH_BYTES:
        return None
    magic, version, _, count, held_seq, _ = _BATCH.unpack_from(value)
    if magic != BATCH_MAGIC or version != VERSION or held_seq != seq or count > ENTRIES:
        return None
    entries, at = [], _BATCH.size
    for _ in range(count):
        if at + _ENTRY.size > len(value):
            return None
        key_len, record_len = _ENTRY.unpack_from(value, at)
        at += _ENTRY.size
        if at + key_len + record_len > len(value):
            return None
        entries.append((value[at:at + key_len], value[at + key_len:at + key_len + record_len]))
        at += key_len + record_len
    return entries if at == len(value) else None


def pack_head(seq: int) -> bytes:
    return _HEAD.pack(HEAD_MAGIC, VERSION, seq)


def unpack_head(value: bytes | int) -> int:
    """The seq a head hint names; 0 for none (missing, or not a hint)."""
    if not isinstance(value, bytes) or len(value) != _HEAD.size:
        return 0
    magic, version, seq = _HEAD.unpack(value)
    return int(seq) if magic == HEAD_MAGIC and version == VERSION and seq <= MAX_SEQ else 0


def parse_cursor(after: bytes) -> tuple[int, int | None] | None:
    """(seq, entries of it read, or None: all) a cursor names; None for ``b"0"`` and for
    anything that is no cursor (read from the oldest)."""
    match = _CURSOR.fullmatch(after) if isinstance(after, bytes) else None
    if match is None or int(match[1]) == 0:
        return None
    return int(match[1]), None if match[2] is None else int(match[2])


def _failed(value: bytes | int) -> TypeGuard[int]:
    """Whether a get answered a failure: neither a value, nor one missing or too large."""
    return isinstance(value, int) and value != TOO_LARGE and value not in MISSING


Ask = Callable[[str, Callable[[Any], Any], Callable[[Any], Sequence[int]]], Any]


class RecordLog:
    """The log named ``name`` (``<prefix>log:<namespace digest>``). ``ask(what, call,
    codes_of)`` runs ``call(client)`` under the tier's deadline and health rules and gives
    its answer, or None when the round trip failed; ``area(client, nbytes)`` is the
    calling thread's registered scratch."""

    def __init__(self, name: str, ask: Ask, area: Callable[[Any, int], np.ndarray]) -> None:
        self._name, self._ask, self._area = name, ask, area
        self._last = 0  # the highest seq known to be taken (a hint for the next append)
        self._waiting = (0, 0.0)  # a batch still being put that reads wait for, since when

    def _key(self, seq: int) -> str:
        return f"{self._name}:{seq}"

    def _head(self, trip: Trip) -> int | None:
        """The seq the head hint names (0: none: missing, or a value that is no hint), or
        None when it is unknown now, which is not no head: another writer upserts it
        (``NOT_READY`` ``HEAD_TRIES`` times), or its read failed (a transfer, say)."""
        value: bytes | int = NOT_READY
        name = f"{self._name}:head"
        for tried in range(HEAD_TRIES):  # being upserted, or a transfer that failed as it was
            time.sleep(HEAD_WAIT_S * tried)
            (value,) = trip.get([name], [HEAD_READ])
            if not _failed(value) or trip.broken:
                break
        if _failed(value):
            value = trip.settled(name, value, HEAD_READ)  # too large for a hint: none
        if _failed(value):
            return None
        head = unpack_head(value)
        self._last = max(self._last, head)
        return head

    def append(self, items: Sequence[tuple[ChunkKey, bytes]]) -> bool:
        batches, dropped = split(items)
        if not batches:
            return not dropped
        trip = self._ask("log", lambda client: self._append(Trip(client, self._area), batches),
                         lambda trip: trip.codes)
        return trip is not None and trip.ok and not dropped

    def _append(self, trip: Trip, batches: list[list[Entry]]) -> Trip:
        pending, won, head = batches, list[int](), self._head(trip)
        if head is None and self._last and trip.held([self._key(self._last)]) == [True]:
            head = 0  # unknown, but our last batch is still kept: the log's end is near it
        if head is not None:  # else nothing is put (past a last seq long removed, a batch
            pending = self._claim(trip, pending, won, max(head, self._last) + 1)  # would be
            # behind every reader)
        if won:
            trip.put([f"{self._name}:head"], [pack_head(max(won))], upsert=True)
            old = [self._key(seq - KEEP) for seq in won if seq > KEEP]
            if old and not trip.broken:
                trip.remove(old)
        trip.ok = not pending and not trip.broken
        return trip

    def _claim(self, trip: Trip, pending: list[list[Entry]], won: list[int], first: int) -> list[list[Entry]]:
        """Puts ``pending`` at ``first`` on and reads each back; a batch another writer's
        value holds the seq of is put again past the last seq held (``_frontier``). The seqs
        won go to ``won``; the batches not put are answered."""
        for _ in range(TRIES):
            if trip.broken:
                return pending
            seqs = list(range(first, first + len(pending)))
            values = [pack_batch(seq, batch) for seq, batch in zip(seqs, pending, strict=True)]
            codes = trip.put([self._key(s) for s in seqs], values)
            back = [] if trip.broken else trip.get([self._key(s) for s in seqs], [len(v) for v in values])
            if trip.broken:
                return pending
            self._last = max(self._last, seqs[-1])
            mine = [held == value for held, value in zip(back, values, strict=True)]
            won += [seq for seq, ok in zip(seqs, mine, strict=True) if ok]
            pending = [batch for batch, ok in zip(pending, mine, strict=True) if not ok]
            if not pending or any(code not in STORED for code in codes):
                break  # all in, or refused (no space): not tried further
            first = self._frontier(trip, seqs[-1] + 1)
        return pending

    def _frontier(self, trip: Trip, start: int) -> int:
        """The seq after the last of the ``PROBE`` from ``start`` the store holds (``start``
        when it holds none), in one round trip however far the head lags: other writers
        took the seqs up to it. Free seqs below it stay free: readers pass over a seq
        missing once the head is past it, and one may have, so a batch put there is lost."""
        held = trip.held([self._key(seq) for seq in range(start, start + PROBE)])
        return start + max((at + 1 for at, taken in enumerate(held) if taken), default=0)

    def read(self, after: bytes, count: int) -> tuple[bytes, list[Entry]] | None:
        answer = self._ask("log", lambda client: self._read(Trip(client, self._area), after, count),
                           lambda answer: answer[0].codes)
        return None if answer is None else answer[1]

    def _start(self, cursor: tuple[int, int | None] | None, head: int) -> tuple[int, int]:
        """The seq to read from, and the entries of it to pass over."""
        oldest = max(1, head - KEEP + 1)
        if cursor is None:
            return oldest, 0
        seq, taken = cursor
        seq, skip = (seq + 1, 0) if taken is None else (seq, taken)
        if head and not oldest <= seq <= head + KEEP:  # fell behind, or the log began again
            return oldest, 0
        return seq, skip

    def _ends(self, code: int, seq: int, head: int) -> bool:
        """Whether the log ends for now at ``seq``, which the store answered ``code`` for:
        missing past the head, or at or below it still being put or failing otherwise (a
        failure that may pass: the batch is read again next time), for ``STALLED_S`` at
        most (a writer gone in the middle of its put, a value the store keeps failing to
        send: passed over then, not waited for until ``KEEP`` batches later). Too large:
        passed over."""
        if code == TOO_LARGE or (code in MISSING and seq <= head):
            return False
        if seq > head:
            return True
        now = time.monotonic()
        if self._waiting[0] != seq:
            self._waiting = (seq, now)
        return now - self._waiting[1] < STALLED_S

    def _read(self, trip: Trip, after: bytes, count: int) -> tuple[Trip, tuple[bytes, list[Entry]]]:
        head = self._head(trip) or 0  # unknown: as none (a missing batch ends the read)
        seq, skip = self._start(parse_cursor(after), head)
        cursor, entries = after, list[Entry]()
        for _ in range(ROUNDS):
            values = [] if trip.broken else trip.get([self._key(s) for s in range(seq, seq + WINDOW)],
                                                     [BATCH_BYTES] * WINDOW)
            for value in values:
                if isinstance(value, int):
                    value = trip.settled(self._key(seq), value, BATCH_BYTES)
                if isinstance(value, int) and self._ends(value, seq, head):
                    return trip, (cursor, entries)
                batch = unpack_batch(value, seq) if isinstance(value, bytes) else []
                taken = (batch or [])[skip:skip + count - len(entries)]
                entries += taken
                if batch and skip + len(taken) < len(batch):
                    return trip, (b"%d.%d" % (seq, skip + len(taken)), entries)
                cursor, seq, skip = b"%d" % seq, seq + 1, 0
                if len(entries) >= count:
                    return trip, (cursor, entries)
            self._last = max(self._last, seq - 1)
        return trip, (cursor, entries)
