"""The on-disk slot: a 4 KiB self-describing header, then the payload.

Every slot of a cache file starts with a header naming its namespace, chunk key, codec,
payload length and checksum, a write generation and its own checksum. A reader trusts a slot
only if the header parses, its checksum matches, and namespace and key are the ones it asked
for; the payload is trusted only if its checksum matches too. A torn, stale or foreign slot
is therefore a miss, never wrong bytes.

A payload may be cut into parts (a hybrid model's chunk: one part per KV cache group), each
with its own checksum, so that a reader can read and check only the parts it needs. The
header then carries a part table after its first ``INDEX_ENTRY_BYTES`` (each part's size
and checksum) and the payload checksum is the checksum of that table: a reader of the whole
payload checks every part, a reader of some parts checks those and the table.

Checksums are XXH3-64 (~32 GiB/s on one core here; docs/benchmarks.md measures what checking
every read costs). They catch corruption and torn writes, not an attacker who can write
the cache files: see docs/reliability.md.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import xxhash

from kvtier.keys import FORMAT_VERSION, KEY_BYTES, ChunkKey

MAGIC = b"KVTSLOT\x00"
REMOVED = b"KVTGONE\x00"  # in place of MAGIC: an index entry's tombstone (``mark_removed``)
HEADER_BYTES = 4096
INDEX_ENTRY_BYTES = 128  # a header's meaningful prefix, as kept in the per-directory index
_BEFORE_KEY = "<8sHHBBH16s"  # magic, version, fields, namespace digest
_LAYOUT = struct.Struct(_BEFORE_KEY + "16sQQQQQ")
KEY_OFFSET = struct.calcsize(_BEFORE_KEY)  # where a header (and an index entry) names its key
_CHECKSUM = struct.Struct("<Q")
_PART = struct.Struct("<QQ")  # a part's size and checksum
MAX_PARTS = (HEADER_BYTES - INDEX_ENTRY_BYTES) // _PART.size
assert _LAYOUT.size + _CHECKSUM.size <= INDEX_ENTRY_BYTES <= HEADER_BYTES
assert KEY_BYTES == 16, "the header keeps namespace digests and chunk keys in 16 bytes"


class Codec(IntEnum):
    NONE = 0
    ZSTD = 1  # zstd of the raw bytes
    ZSTD_SHUFFLE2 = 2  # byte-plane shuffle of 16-bit elements, then zstd


class HeaderError(ValueError):
    """A slot header that cannot be trusted; the message says why."""


@dataclass(frozen=True)
class SlotHeader:
    """What a slot says about itself."""

    namespace: bytes  # Namespace.digest()
    key: ChunkKey
    codec: Codec
    payload_bytes: int  # bytes stored after the header
    raw_bytes: int  # bytes after decoding
    payload_checksum: int  # XXH3-64 of the stored payload, or of its part table
    generation: int  # larger is newer
    created_ns: int  # wall clock at write, for age-based cleanup
    format_version: int = FORMAT_VERSION
    parts: tuple[tuple[int, int], ...] = ()  # (size, XXH3-64) of each part; () = one payload
    num_parts: int = 0  # as the header says (its table is not in an index entry's prefix)

    @classmethod
    def in_parts(cls, namespace: bytes, key: ChunkKey, parts: tuple[tuple[int, int], ...],
                 generation: int, created_ns: int) -> SlotHeader:
        """The header of an uncompressed payload in ``parts`` ((size, checksum) each)."""
        if not 1 < len(parts) <= MAX_PARTS:
            raise ValueError(f"a slot holds 2 to {MAX_PARTS} parts, not {len(parts)}")
        size = sum(n for n, _ in parts)
        return cls(namespace, key, Codec.NONE, size, size, _table_checksum(parts), generation,
                   created_ns, FORMAT_VERSION, parts, len(parts))

    def encode(self, into=None, record: bytes = b"") -> bytes | None:
        """The 4 KiB header; written into ``into`` (any writable buffer) when given. A
        ``record`` (``token_record``) follows the part table when it fits there."""
        body = _LAYOUT.pack(
            MAGIC, self.format_version, HEADER_BYTES, int(self.codec), 0, len(self.parts),
            self.namespace, self.key, self.generation, self.payload_bytes, self.raw_bytes,
            self.payload_checksum, self.created_ns,
        )
        checked = body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))
        table = _table(self.parts)
        if into is None:
            into = bytearray(HEADER_BYTES)
            self.encode(into, record)
            return bytes(into)
        view = memoryview(into).cast("B")
        view[: len(checked)] = checked
        view[len(checked):INDEX_ENTRY_BYTES] = bytes(INDEX_ENTRY_BYTES - len(checked))
        view[INDEX_ENTRY_BYTES:INDEX_ENTRY_BYTES + len(table)] = table
        view[INDEX_ENTRY_BYTES + len(table):HEADER_BYTES] = bytes(
            HEADER_BYTES - INDEX_ENTRY_BYTES - len(table))
        at = INDEX_ENTRY_BYTES + len(table)  # token_record.record_offset
        if record and at + len(record) <= HEADER_BYTES:
            view[at:at + len(record)] = record
        return None

    def part_offsets(self) -> list[tuple[int, int]]:
        """(offset in the payload, size) of each part; one part when not in parts."""
        if not self.parts:
            return [(0, self.payload_bytes)]
        offsets, at = [], 0
        for size, _ in self.parts:
            offsets.append((at, size))
            at += size
        return offsets


def is_blank(data: bytes | memoryview) -> bool:
    """True for a never-written (or invalidated) header: no magic."""
    return bytes(data[: len(MAGIC)]) != MAGIC


def written_rows(rows: np.ndarray) -> np.ndarray:
    """The numbers of the rows of ``rows`` (headers or index entries, one a row of uint8)
    that are not ``is_blank``."""
    return np.flatnonzero((rows[:, :len(MAGIC)] == np.frombuffer(MAGIC, np.uint8)).all(axis=1))


def mark_removed(rows: np.ndarray) -> None:
    """Make index entries (``rows``: one entry a row of uint8, changed in place) say that
    their slots' chunks are removed: an entry naming a chunk becomes its tombstone
    (``REMOVED`` in place of ``MAGIC``, the rest as it was), a tombstone stays, anything else
    is zeroed. A tombstone has no ``MAGIC``: every reader, of any version, takes it for a
    blank entry (``is_blank``). ``kvtier verify --repair`` reads it (``removed_from``) to
    finish a removal cut short between the entry and the slot's header, rather than take
    the chunk still in the slot for one the index missed and index it again. No format
    version changes: an older kvtier reads and writes the index as before (its blanks are
    zeros, so it only leaves a repair less to go by)."""
    magic = rows[:, :len(MAGIC)]
    named = (magic == np.frombuffer(MAGIC, np.uint8)).all(axis=1)
    kept = named | (magic == np.frombuffer(REMOVED, np.uint8)).all(axis=1)
    rows[~kept] = 0
    rows[named, :len(REMOVED)] = np.frombuffer(REMOVED, np.uint8)


def removed_entries(data: bytes, count: int) -> bytes:
    """``count`` index entries read as ``data`` (zeros past its end), ``mark_removed``."""
    rows = np.zeros((count, INDEX_ENTRY_BYTES), np.uint8)
    rows.reshape(-1)[:len(data)] = np.frombuffer(data, np.uint8)
    mark_removed(rows)
    return rows.tobytes()


def removed_from(entry: bytes | None, header: bytes) -> bool:
    """Whether index entry ``entry`` is the tombstone (``mark_removed``) of the slot header
    ``header`` (at least its first ``INDEX_ENTRY_BYTES``, checked by the caller): the chunk
    was removed and its slot's header not blanked yet."""
    return (entry is not None and entry[:len(REMOVED)] == REMOVED
            and entry[len(REMOVED):INDEX_ENTRY_BYTES] == bytes(header[len(MAGIC):INDEX_ENTRY_BYTES]))


def decode_header(data: bytes | memoryview) -> SlotHeader:
    """Parse and check a header; raise :class:`HeaderError` saying what is wrong."""
    if len(data) < _LAYOUT.size + _CHECKSUM.size:
        raise HeaderError(f"header truncated to {len(data)} bytes")
    body = bytes(data[: _LAYOUT.size])
    (magic, version, header_bytes, codec, _flags, num_parts, namespace, key, generation,
     payload_bytes, raw_bytes, payload_checksum, created_ns) = _LAYOUT.unpack(body)
    if magic != MAGIC:
        raise HeaderError("no slot magic: blank, invalidated or not a kvtier file")
    (checksum,) = _CHECKSUM.unpack_from(data, _LAYOUT.size)
    if checksum != xxhash.xxh3_64_intdigest(body):
        raise HeaderError("header checksum mismatch: torn or corrupt header")
    if version != FORMAT_VERSION:
        raise HeaderError(f"format version {version}, this kvtier reads {FORMAT_VERSION}")
    if header_bytes != HEADER_BYTES:
        raise HeaderError(f"header size {header_bytes}, expected {HEADER_BYTES}")
    try:
        codec_value = Codec(codec)
    except ValueError:
        raise HeaderError(f"unknown codec {codec}") from None
    if not 0 < payload_bytes <= raw_bytes:
        raise HeaderError(f"payload length {payload_bytes} does not fit raw length {raw_bytes}")
    parts = _parts(data, num_parts, payload_bytes, payload_checksum, codec_value)
    return SlotHeader(namespace, ChunkKey(key), codec_value, payload_bytes, raw_bytes,
                      payload_checksum, generation, created_ns, version, parts, num_parts)


def _parts(data: bytes | memoryview, num_parts: int, payload_bytes: int, checksum: int,
           codec: Codec) -> tuple[tuple[int, int], ...]:
    """The part table of a header in ``num_parts`` parts (empty where ``data`` is only an
    index entry's prefix); ``HeaderError`` when it does not describe the payload."""
    if num_parts == 0:
        return ()
    if num_parts == 1 or num_parts > MAX_PARTS or codec is not Codec.NONE:
        raise HeaderError(f"a table of {num_parts} parts for a {codec.name} payload")
    if len(data) < HEADER_BYTES:
        return ()
    raw = bytes(data[INDEX_ENTRY_BYTES:INDEX_ENTRY_BYTES + num_parts * _PART.size])
    parts = tuple(_PART.iter_unpack(raw))
    if _table_checksum(parts) != checksum:
        raise HeaderError("part table checksum mismatch: torn or corrupt header")
    if sum(size for size, _ in parts) != payload_bytes:
        raise HeaderError(f"parts of {sum(size for size, _ in parts)} bytes in a payload of "
                          f"{payload_bytes}")
    return parts


def _table(parts: tuple[tuple[int, int], ...]) -> bytes:
    return b"".join(_PART.pack(size, checksum) for size, checksum in parts)


def _table_checksum(parts: tuple[tuple[int, int], ...]) -> int:
    return xxhash.xxh3_64_intdigest(_table(parts))


def payload_checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def payload_matches(header: SlotHeader, payload: bytes | memoryview) -> bool:
    """Whether ``payload`` (at least the header's payload bytes) is what the header says:
    its checksum, or each of its parts' (``header`` decoded from a whole header)."""
    view = memoryview(payload).cast("B")[: header.payload_bytes]
    if len(view) < header.payload_bytes:
        return False
    if not header.num_parts:
        return payload_checksum(view) == header.payload_checksum
    if len(header.parts) != header.num_parts:
        raise ValueError("a payload in parts is checked against a whole header, not an "
                         "index entry's prefix")
    return all(payload_checksum(view[at:at + size]) == checksum
               for (at, size), (_, checksum) in zip(header.part_offsets(), header.parts,
                                                    strict=True))

