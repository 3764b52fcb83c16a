"""The on-disk slot: a 4 KiB self-describing header, then the payload.

Every slot of a cache file starts with a header naming its namespace, chunk key, codec,
payload length and checksum, a write generation and its own checksum. A reader trusts a slot
only if the header parses, its checksum matches, and namespace and key are the ones it asked
for; the payload is trusted only if its checksum matches too. A torn, stale or foreign slot
is therefore a miss, never wrong bytes.

Checksums are XXH3-64 (~32 GiB/s on one core here; docs/benchmarks.md measures what checking
every read costs). They catch corruption and torn writes, not an attacker who can write
the cache files: see docs/reliability.md.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import xxhash

from kvtier.keys import FORMAT_VERSION, KEY_BYTES, ChunkKey

MAGIC = b"KVTSLOT\x00"
HEADER_BYTES = 4096
INDEX_ENTRY_BYTES = 128  # a header's meaningful prefix, as kept in the per-directory index
_LAYOUT = struct.Struct("<8sHHBBH16s16sQQQQQ")
_CHECKSUM = struct.Struct("<Q")
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
    payload_checksum: int  # XXH3-64 of the stored payload
    generation: int  # larger is newer
    created_ns: int  # wall clock at write, for age-based cleanup
    format_version: int = FORMAT_VERSION

    def encode(self, into=None) -> bytes | None:
        """The 4 KiB header; written into ``into`` (any writable buffer) when given."""
        body = _LAYOUT.pack(
            MAGIC, self.format_version, HEADER_BYTES, int(self.codec), 0, 0, self.namespace,
            self.key, self.generation, self.payload_bytes, self.raw_bytes,
            self.payload_checksum, self.created_ns,
        )
        checked = body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))
        if into is None:
            return checked.ljust(HEADER_BYTES, b"\0")
        view = memoryview(into).cast("B")
        view[: len(checked)] = checked
        view[len(checked):HEADER_BYTES] = bytes(HEADER_BYTES - len(checked))
        return None


def is_blank(data: bytes | memoryview) -> bool:
    """True for a never-written (or invalidated) header: no magic."""
    return bytes(data[: len(MAGIC)]) != MAGIC


def decode_header(data: bytes | memoryview) -> SlotHeader:
    """Parse and check a header; raise :class:`HeaderError` saying what is wrong."""
    if len(data) < _LAYOUT.size + _CHECKSUM.size:
        raise HeaderError(f"header truncated to {len(data)} bytes")
    body = bytes(data[: _LAYOUT.size])
    (magic, version, header_bytes, codec, _flags, _pad, namespace, key, generation,
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
    return SlotHeader(namespace, ChunkKey(key), codec_value, payload_bytes, raw_bytes,
                      payload_checksum, generation, created_ns, version)


def payload_checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)

