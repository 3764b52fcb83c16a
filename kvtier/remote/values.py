"""A chunk as a remote store holds it: the meaningful 128 bytes of kvtier's slot header
(``kvtier.io.format``: namespace, key, codec, lengths, payload checksum, its own checksum),
for a chunk in parts (a hybrid model's: one part per KV cache group) its part table (16
bytes a part: size and checksum), then the payload. A value that is truncated, corrupted,
or holds another chunk (a key written by something else) fails the checks: a miss, never
wrong bytes. A reader that needs only some parts reads the header, the table and those
parts (``ValueFormat.ranges``) and checks each against the table.

Keys are ``<prefix><namespace digest>:<chunk key>`` in hex, so one store serves many models,
layouts and tenants side by side.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

import numpy as np

from kvtier.disk.parts import ChunkParts
from kvtier.io.format import (
    HEADER_BYTES,
    INDEX_ENTRY_BYTES,
    MAX_PARTS,
    Codec,
    HeaderError,
    SlotHeader,
    decode_header,
    payload_checksum,
    payload_matches,
)
from kvtier.keys import ChunkKey

PART_ENTRY_BYTES = (HEADER_BYTES - INDEX_ENTRY_BYTES) // MAX_PARTS
VALUE_HEADER_BYTES = INDEX_ENTRY_BYTES  # the header of a value not in parts


def value_key(prefix: str, namespace: bytes, key: ChunkKey) -> bytes:
    return f"{prefix}{namespace.hex()}:{bytes(key).hex()}".encode()


def decode_value_header(value: bytes | memoryview) -> tuple[SlotHeader, int]:
    """The header a value starts with (checked, its part table too) and how many bytes it
    takes; ``HeaderError`` saying what is wrong."""
    if len(value) < INDEX_ENTRY_BYTES:
        raise HeaderError(f"value truncated to {len(value)} bytes")
    header = decode_header(value[:INDEX_ENTRY_BYTES])
    if not header.num_parts:
        return header, INDEX_ENTRY_BYTES
    size = INDEX_ENTRY_BYTES + header.num_parts * PART_ENTRY_BYTES
    if len(value) < size:
        raise HeaderError(f"value truncated to {len(value)} bytes, inside its part table")
    return decode_header(bytes(value[:size]).ljust(HEADER_BYTES, b"\0")), size


class ValueFormat:
    """The values of one remote tier: chunks of ``raw_bytes`` of one namespace (``namespace``:
    its digest), in parts of ``parts`` bytes each (() for one payload).

    ``header_bytes`` is where the payload starts in a value; ``header(key, raw)`` the bytes
    before it; ``problem`` and ``parts_problem`` say why what was read is not the chunk
    (empty when it is); ``ranges(wanted)`` the byte ranges of a value a read of some parts
    moves."""

    def __init__(self, namespace: bytes, raw_bytes: int, parts: Sequence[int] = ()) -> None:
        self.namespace, self.raw_bytes, self.sizes = namespace, raw_bytes, tuple(parts)
        self._parts = ChunkParts(raw_bytes, parts)  # checks the sizes
        self.spans = self._parts.spans
        self.header_bytes = INDEX_ENTRY_BYTES + len(parts) * PART_ENTRY_BYTES

    def header(self, key: ChunkKey, raw: np.ndarray) -> bytes:
        """The header of the value of ``raw`` (the chunk's bytes, contiguous ``uint8``)."""
        now = time.time_ns()
        if self.sizes:
            header = self._parts.header(self.namespace, key, raw, now, now)
        else:
            header = SlotHeader(self.namespace, key, Codec.NONE, raw.nbytes, raw.nbytes,
                                payload_checksum(raw.data), now, now)
        encoded = header.encode()
        assert encoded is not None
        return encoded[:self.header_bytes]

    def encode(self, key: ChunkKey, payload: np.ndarray) -> memoryview:
        """The value for ``payload`` (the chunk's raw bytes, any dtype): its bytes are
        copied once, behind the header."""
        raw = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        value = bytearray(self.header_bytes + raw.nbytes)
        value[:self.header_bytes] = self.header(key, raw)
        np.frombuffer(value, np.uint8, offset=self.header_bytes)[:] = raw
        return memoryview(value)

    def _header_problem(self, header_bytes: bytes | memoryview, key: ChunkKey
                        ) -> tuple[SlotHeader | None, str]:
        try:
            header, size = decode_value_header(header_bytes)
        except HeaderError as exc:
            return None, str(exc)
        if header.namespace != self.namespace or header.key != key:
            return None, "value holds another chunk"
        if header.codec is not Codec.NONE or header.raw_bytes != self.raw_bytes \
                or header.payload_bytes != self.raw_bytes:
            return None, (f"value of {header.raw_bytes} raw bytes ({header.codec.name}), "
                          f"expected {self.raw_bytes}")
        if tuple(n for n, _ in header.parts) != self.sizes or size != self.header_bytes:
            return None, (f"value in parts of {[n for n, _ in header.parts]} bytes, this tier's "
                          f"are {list(self.sizes)}")
        return header, ""

    def problem(self, header_bytes: bytes | memoryview, payload: bytes | memoryview,
                key: ChunkKey) -> str:
        """Why a value read as its header and its payload apart is not chunk ``key``,
        checked down to its payload's checksum (each part's); empty when it is."""
        header, problem = self._header_problem(header_bytes, key)
        return problem if header is None else _payload_problem(header, payload)

    def value_problem(self, value: bytes | memoryview, key: ChunkKey) -> str:
        """As ``problem``, for a value read whole (its header read as long as it says)."""
        header, problem = self._header_problem(value, key)
        return problem if header is None else _payload_problem(
            header, memoryview(value)[self.header_bytes:])

    def reads_alone(self, wanted: Collection[int]) -> bool:
        """Whether a read of parts ``wanted`` (indexes) is a read of less than the chunk."""
        return bool(self.sizes) and len(set(wanted) & set(range(len(self.sizes)))) < len(self.sizes)

    def ranges(self, wanted: Collection[int]) -> list[tuple[int, int]]:
        """Byte ranges ``[start, end)`` of the payload holding parts ``wanted``: adjacent
        ones together."""
        runs: list[tuple[int, int]] = []
        for i, (at, end) in enumerate(self.spans):
            if i not in wanted:
                continue
            if runs and runs[-1][1] == at:
                runs[-1] = (runs[-1][0], end)
            else:
                runs.append((at, end))
        return runs

    def parts_problem(self, header_bytes: bytes | memoryview, payload: np.ndarray,
                      key: ChunkKey, wanted: Collection[int]) -> str:
        """Why parts ``wanted`` of chunk ``key``, read into their places in ``payload``
        (the chunk's bytes, ``uint8``) with the value's header, are not the chunk's."""
        header, problem = self._header_problem(header_bytes, key)
        if header is None:
            return problem
        for i, ((at, end), (_, checksum)) in enumerate(zip(self.spans, header.parts, strict=True)):
            if i in wanted and payload_checksum(payload[at:end].data) != checksum:
                return f"part {i}: payload checksum mismatch"
        return ""


def _payload_problem(header: SlotHeader, payload: bytes | memoryview) -> str:
    if len(payload) != header.payload_bytes:
        return f"payload of {len(payload)} bytes, its header says {header.payload_bytes}"
    return "" if payload_matches(header, payload) else "payload checksum mismatch"
