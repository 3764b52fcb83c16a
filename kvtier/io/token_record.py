"""A slot's token record: what an engine needs to name a chunk in its KV events without
having seen a request for it.

A router that follows KV events (vllm-router's ``kv_aware``) learns an engine's blocks from
each event's token ids and block hashes. An engine can say that of a chunk it computed; of a
chunk found on disk after a restart, or written by another engine of a shared directory, it
knows only the key. So the writer puts the chunk's token ids and the engine's hash of the
block before it (``parent``, empty for a prompt's first chunk) in the unused end of the slot
header, after the part table. A reader recomputes the block hashes from them and publishes
the chunk only when they name its key (``block_hash_chunk_key``): a record that lies, or
belongs to another slot, is never published.

Layout, little-endian: ``MAGIC`` (8 bytes), version (u16), parent length (u16, at most
``MAX_PARENT``), token count (u32), the parent, the tokens (int32 each), then XXH3-64 of all
that. A header without one (an older writer's, a chunk whose tokens do not fit, a standalone
store's) holds zeros there: no record. Everything is bounded by the header's 4 KiB.
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass

import xxhash

from kvtier.io.format import HEADER_BYTES, INDEX_ENTRY_BYTES

MAGIC = b"KVTTOKS\x00"
VERSION = 1
MAX_PARENT = 64  # bytes of an engine's block hash (vLLM's sha256: 32)
_HEAD = struct.Struct("<8sHHI")
_CHECKSUM = struct.Struct("<Q")
_PART_BYTES = 16  # a part table entry (``format._PART``)


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """A chunk's token ids and the engine's hash of the block before it (b"" for none)."""

    parent: bytes
    tokens: array  # int32


def record_offset(num_parts: int) -> int:
    """Where a header of ``num_parts`` parts keeps its record: after the part table."""
    return INDEX_ENTRY_BYTES + num_parts * _PART_BYTES


def record_room(num_parts: int) -> int:
    """The most tokens a record holds in a header of ``num_parts`` parts (with the longest
    parent)."""
    spare = HEADER_BYTES - record_offset(num_parts) - _HEAD.size - MAX_PARENT - _CHECKSUM.size
    return max(0, spare // 4)


def encode_record(parent: bytes, tokens: array) -> bytes:
    """The record of ``tokens`` (int32) after ``parent``; ``ValueError`` for a parent
    longer than ``MAX_PARENT`` or tokens that are not int32."""
    if len(parent) > MAX_PARENT:
        raise ValueError(f"a block hash of {len(parent)} bytes; a record keeps at most "
                         f"{MAX_PARENT}")
    if tokens.typecode != "i" or tokens.itemsize != 4:
        raise ValueError(f"token ids as array('i') of int32, not {tokens.typecode!r}")
    if sys.byteorder == "big":
        tokens = array("i", tokens)
        tokens.byteswap()  # the record is little-endian
    body = _HEAD.pack(MAGIC, VERSION, len(parent), len(tokens)) + parent + tokens.tobytes()
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def read_record(header: bytes | memoryview, num_parts: int) -> TokenRecord | None:
    """The record of a whole header of ``num_parts`` parts (its part count as decoded), or
    None: none there, or one that is cut short, too long, of another version, or whose
    checksum does not match. Reads nothing past the header."""
    data = memoryview(header).cast("B")[:HEADER_BYTES]
    return _parse(data[record_offset(num_parts):], exact=False)


def decode_record(data: bytes | memoryview) -> TokenRecord | None:
    """A record on its own (as a remote store's log keeps it: exactly its bytes, at most
    ``HEADER_BYTES``), or None on anything but a whole, checked record."""
    view = memoryview(data).cast("B")
    return _parse(view, exact=True) if len(view) <= HEADER_BYTES else None


def _parse(data: memoryview, exact: bool) -> TokenRecord | None:
    if _HEAD.size > len(data) or bytes(data[:len(MAGIC)]) != MAGIC:
        return None
    _, version, parent_len, count = _HEAD.unpack_from(data, 0)
    end = _HEAD.size + parent_len + 4 * count
    if version != VERSION or parent_len > MAX_PARENT or end + _CHECKSUM.size > len(data) \
            or (exact and end + _CHECKSUM.size != len(data)):
        return None
    (checksum,) = _CHECKSUM.unpack_from(data, end)
    if checksum != xxhash.xxh3_64_intdigest(data[:end]):
        return None
    tokens = array("i")
    tokens.frombytes(bytes(data[_HEAD.size + parent_len:end]))
    if sys.byteorder == "big":
        tokens.byteswap()  # the record is little-endian
    return TokenRecord(bytes(data[_HEAD.size:_HEAD.size + parent_len]), tokens)
