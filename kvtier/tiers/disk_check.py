"""Checking a disk slot read back: what makes its bytes the chunk asked for, or CORRUPT."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from kvtier.io import codec as codecs
from kvtier.io.format import Codec, HeaderError, decode_header, payload_checksum
from kvtier.io.scratch import ThreadScratch
from kvtier.keys import ChunkKey


def slot_problem(header_buf: np.ndarray, key: ChunkKey, payload: list[np.ndarray], got: int,
                 codec: Codec, ns_digest: bytes, raw_bytes: int, verify_payload: bool) -> str:
    """Why the slot read into ``header_buf`` and ``payload`` (pieces in order; ``got``
    payload bytes arrived)
    does not hold chunk ``key`` of namespace ``ns_digest`` as written with ``codec``; empty
    when it does. The header must decode and name this namespace, key, codec and raw size,
    the whole payload must have arrived and, with ``verify_payload``, match its checksum."""
    try:
        header = decode_header(header_buf.data)
    except HeaderError as exc:
        return str(exc)
    if header.namespace != ns_digest or header.key != key:
        return "slot holds another chunk (stale or foreign)"
    if header.codec is not codec or header.raw_bytes != raw_bytes:
        return "slot header does not match what was written"
    if codec is Codec.NONE and header.payload_bytes != raw_bytes:
        return f"uncompressed payload of {header.payload_bytes} bytes, the chunk has {raw_bytes}"
    if got < header.payload_bytes:
        return f"payload truncated: {max(got, 0)} of {header.payload_bytes} bytes"
    if verify_payload and checksum_of(payload, header.payload_bytes) != header.payload_checksum:
        return "payload checksum mismatch"
    return ""


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
