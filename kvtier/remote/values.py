"""A chunk as a remote store holds it: the meaningful 128 bytes of kvtier's slot header
(``kvtier.io.format``: namespace, key, codec, lengths, payload checksum, its own checksum),
then the payload. A value that is truncated, corrupted, or holds another chunk (a key
written by something else) fails ``value_problem``: a miss, never wrong bytes.

Keys are ``<prefix><namespace digest>:<chunk key>`` in hex, so one store serves many models,
layouts and tenants side by side.
"""

from __future__ import annotations

import time

import numpy as np

from kvtier.io.format import (
    INDEX_ENTRY_BYTES,
    Codec,
    HeaderError,
    SlotHeader,
    decode_header,
    payload_checksum,
)
from kvtier.keys import ChunkKey

VALUE_HEADER_BYTES = INDEX_ENTRY_BYTES


def value_key(prefix: str, namespace: bytes, key: ChunkKey) -> bytes:
    return f"{prefix}{namespace.hex()}:{bytes(key).hex()}".encode()


def value_header(namespace: bytes, key: ChunkKey, raw: np.ndarray) -> bytes:
    """The header of the value of ``raw`` (the chunk's bytes, contiguous ``uint8``)."""
    header = SlotHeader(namespace, key, Codec.NONE, raw.nbytes, raw.nbytes,
                        payload_checksum(raw.data), time.time_ns(), time.time_ns())
    encoded = header.encode()
    assert encoded is not None
    return encoded[:VALUE_HEADER_BYTES]


def encode_value(namespace: bytes, key: ChunkKey, payload: np.ndarray) -> memoryview:
    """The value for ``payload`` (the chunk's raw bytes, any dtype): its bytes are copied
    once, behind the header."""
    raw = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    value = bytearray(VALUE_HEADER_BYTES + raw.nbytes)
    value[:VALUE_HEADER_BYTES] = value_header(namespace, key, raw)
    np.frombuffer(value, np.uint8, offset=VALUE_HEADER_BYTES)[:] = raw
    return memoryview(value)


def value_problem(value: bytes | memoryview, namespace: bytes, key: ChunkKey,
                  raw_bytes: int) -> str:
    """Why ``value`` is not chunk ``key`` of ``namespace`` (``raw_bytes`` long), checked
    down to its payload's checksum; empty when it is."""
    if len(value) < VALUE_HEADER_BYTES:
        return f"value truncated to {len(value)} bytes"
    view = memoryview(value)
    return parts_problem(view[:VALUE_HEADER_BYTES], view[VALUE_HEADER_BYTES:], namespace, key,
                         raw_bytes)


def parts_problem(header_bytes: bytes | memoryview, payload: bytes | memoryview,
                  namespace: bytes, key: ChunkKey, raw_bytes: int) -> str:
    """As ``value_problem``, for a value read as its header and its payload apart."""
    try:
        header = decode_header(header_bytes)
    except HeaderError as exc:
        return str(exc)
    if header.namespace != namespace or header.key != key:
        return "value holds another chunk"
    if header.codec is not Codec.NONE or header.raw_bytes != raw_bytes \
            or header.payload_bytes != raw_bytes:
        return f"value of {header.raw_bytes} raw bytes ({header.codec.name}), expected {raw_bytes}"
    if len(payload) != header.payload_bytes:
        return f"payload of {len(payload)} bytes, its header says {header.payload_bytes}"
    if payload_checksum(payload) != header.payload_checksum:
        return "payload checksum mismatch"
    return ""
