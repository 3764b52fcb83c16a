"""Checking a disk slot read back: what makes its bytes the chunk asked for, or CORRUPT."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xxhash

from kvtier.io import codec as codecs
from kvtier.io.format import Codec, HeaderError, SlotHeader, decode_header, payload_checksum
from kvtier.io.scratch import ThreadScratch
from kvtier.keys import ChunkKey


def slot_problem(header_buf: np.ndarray, key: ChunkKey, payload: list[np.ndarray], got: int,
                 codec: Codec, ns_digest: bytes, raw_bytes: int, verify_payload: bool,
                 wanted: Sequence[tuple[int, int]] | None = None, stored: int | None = None) -> str:
    """Why the slot read into ``header_buf`` and ``payload`` (pieces in order; ``got``
    payload bytes arrived)
    does not hold chunk ``key`` of namespace ``ns_digest`` as written with ``codec``; empty
    when it does. The header must decode and name this namespace, key, codec and raw size,
    the whole payload must have arrived and, with ``verify_payload``, match its checksum.

    With ``wanted`` (a read of some parts: the (size, index) of each part the slot must be
    in, and which of them were read) only those parts were read and are checked. With
    ``stored`` (the payload length the reader's index or a writer's log gives, which it
    decodes) the header's must be the same: no byte its checksum does not cover is used."""
    try:
        header = decode_header(header_buf.data)
    except HeaderError as exc:
        return str(exc)
    if wanted is not None:
        return _parts_problem(header, key, payload[0], ns_digest, raw_bytes, verify_payload,
                              wanted)
    if header.namespace != ns_digest or header.key != key:
        return "slot holds another chunk (stale or foreign)"
    if header.codec is not codec or header.raw_bytes != raw_bytes:
        return "slot header does not match what was written"
    if codec is Codec.NONE and header.payload_bytes != raw_bytes:
        return f"uncompressed payload of {header.payload_bytes} bytes, the chunk has {raw_bytes}"
    if stored is not None and header.payload_bytes != stored:
        return f"payload of {header.payload_bytes} bytes, {stored} where the slot was recorded"
    if got < header.payload_bytes:
        return f"payload truncated: {max(got, 0)} of {header.payload_bytes} bytes"
    if verify_payload and not _payload_ok(header, payload):
        return "payload checksum mismatch"
    return ""


def _parts_problem(header: SlotHeader, key: ChunkKey, payload: np.ndarray, ns_digest: bytes,
                   raw_bytes: int, verify_payload: bool,
                   wanted: Sequence[tuple[int, int]]) -> str:
    """``slot_problem`` for a read of some parts (``wanted``: (size of every part, 1 where
    it was read)) into ``payload``."""
    if header.namespace != ns_digest or header.key != key:
        return "slot holds another chunk (stale or foreign)"
    if header.codec is not Codec.NONE or header.raw_bytes != raw_bytes:
        return "slot header does not match what was written"
    if [size for size, _ in header.parts] != [size for size, _ in wanted]:
        return "slot's parts are not this chunk's"
    if not verify_payload:
        return ""
    for (at, size), (_, checksum), (_, read) in zip(header.part_offsets(), header.parts, wanted,
                                                  strict=True):
        if read and payload_checksum(payload[at:at + size].data) != checksum:
            return "payload checksum mismatch"
    return ""


def _payload_ok(header: SlotHeader, pieces: list[np.ndarray]) -> bool:
    """Whether the payload in ``pieces`` (in order) matches its checksum, or each of its
    parts' checksums."""
    if not header.num_parts:
        return checksum_of(pieces, header.payload_bytes) == header.payload_checksum
    return all(checksum_of(_window(pieces, at, size), size) == checksum
               for (at, size), (_, checksum) in zip(header.part_offsets(), header.parts,
                                                    strict=True))


def _window(pieces: list[np.ndarray], at: int, size: int) -> list[np.ndarray]:
    """The bytes ``at`` to ``at + size`` of ``pieces`` taken in order, as slices of them."""
    out = []
    for piece in pieces:
        if size <= 0:
            break
        if at >= piece.size:
            at -= piece.size
            continue
        out.append(piece[at:at + size])
        size -= out[-1].size
        at = 0
    return out


def checksum_of(pieces: list[np.ndarray], nbytes: int) -> int:
    """The payload checksum of the first ``nbytes`` of ``pieces`` taken in order."""
    if len(pieces) == 1:
        return payload_checksum(pieces[0][:nbytes].data)
    digest = xxhash.xxh3_64()
    update: Callable[[Any], None] = digest.update  # numpy arrays are buffers
    for piece in pieces:
        if nbytes >= piece.size:
            update(piece)  # a whole piece, as is: no slice to make
        elif nbytes > 0:
            update(piece[:nbytes])
        nbytes -= piece.size
    return digest.intdigest()


def decode_into(codec: Codec, stored: np.ndarray, dst: np.ndarray | list[np.ndarray],
                scratch: ThreadScratch) -> None:
    """Decode a compressed payload into ``dst``: one buffer, or pieces filled in order
    (decoded into this thread's scratch first). ``ValueError`` when it does not decode."""
    if isinstance(dst, np.ndarray):
        codecs.decode(codec, stored.data, dst[: scratch.raw_bytes])
        return
    raw = scratch.raw()
    codecs.decode(codec, stored.data, raw)
    done = 0
    for piece in dst:
        piece[:] = raw[done:done + piece.size]
        done += piece.size


def holds_another(fd: int, offset: int, key: ChunkKey | None, ns_digest: bytes,
                  header_buf: np.ndarray) -> bool:
    """Whether the slot at ``offset`` of ``fd`` now holds a whole header of another chunk
    than ``key`` (a later write into a slot freed meanwhile; never, for None): one header's
    read into ``header_buf`` (aligned, as ``O_DIRECT`` wants; zeros past the end of the
    file), its errors for the caller."""
    got = os.preadv(fd, [header_buf.data], offset)
    header_buf[got:] = 0
    try:
        header = decode_header(header_buf.data[:got])
    except HeaderError:
        return False
    return key is not None and (header.namespace != ns_digest or header.key != key)
