"""Checking one value of a remote store (Valkey/Redis) without ever holding it whole, for
``kvtier inspect URL``: its length (``STRLEN``), its header (``GETRANGE`` of at most
``HEADER_BYTES``), then its payload in pieces of at most ``PIECE`` bytes through the
checksum of each part (XXH3-64, streamed). Memory per value is bounded by ``PIECE``, however
large the value a key under the prefix holds.

A value is kvtier's chunk when its header checks out, names the key it is stored under,
says as many payload bytes as follow it and their checksums match (each part's, for a
hybrid model's chunk): the same checks as ``io.format.payload_matches`` on a value read
whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

from kvtier.io.format import HEADER_BYTES, HeaderError, SlotHeader
from kvtier.remote.values import decode_value_header

PIECE = 1 << 20  # bytes of a value read at a time


@dataclass(frozen=True)
class ValueCheck:
    """What checking one value found: ``problem`` ("" when it is kvtier's chunk) and its
    payload's bytes (those after its header)."""

    problem: str
    payload_bytes: int


def check_value(client: Any, name: bytes, prefix: str, piece: int = PIECE) -> ValueCheck | None:
    """Check the value of key ``name`` (see the module docstring) reading at most ``piece``
    bytes at a time; None when there is none (evicted meanwhile). ``ResponseError`` when it
    is not a string (``WRONGTYPE``)."""
    length = client.strlen(name)
    if not length:
        return None
    try:
        header, header_bytes = decode_value_header(client.getrange(name, 0, min(length, HEADER_BYTES) - 1))
    except HeaderError as exc:
        return ValueCheck(str(exc), length)
    payload_bytes = length - header_bytes
    expected = f"{prefix}{header.namespace.hex()}:{bytes(header.key).hex()}".encode()
    if expected != name:
        return ValueCheck("holds another chunk", payload_bytes)
    if payload_bytes != header.payload_bytes:
        return ValueCheck("payload damaged", payload_bytes)
    matches = _payload_matches(client, name, header, header_bytes, piece)
    if matches is None:
        return None
    return ValueCheck("" if matches else "payload damaged", payload_bytes)


def _payload_matches(client: Any, name: bytes, header: SlotHeader, start: int,
                     piece: int) -> bool | None:
    """Whether the payload (from byte ``start`` of the value) matches each part's checksum,
    read piece by piece; None when the value is gone before its end was read."""
    checksums = [checksum for _, checksum in header.parts] or [header.payload_checksum]
    spans = header.part_offsets()
    hasher, part, left = xxhash.xxh3_64(), 0, spans[0][1]
    matches = True
    for at in range(start, start + header.payload_bytes, piece):
        data = memoryview(client.getrange(name, at, min(at + piece, start + header.payload_bytes) - 1))
        if not data:
            return None if not client.exists(name) else False
        while data:
            taken = data[:left]
            hasher.update(taken)
            data, left = data[len(taken):], left - len(taken)
            if left == 0:
                matches = matches and hasher.intdigest() == checksums[part]
                part += 1
                if part < len(spans):
                    hasher, left = xxhash.xxh3_64(), spans[part][1]
    return matches and part == len(spans)
