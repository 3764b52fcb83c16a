"""The disk tier's writes, apart from its reads: a chunk made into what its slot holds, a
header naming it and checking its payload (each part's on its own for a chunk in parts),
then the payload, compressed when that makes it smaller; a run of slots written in one
vectored call; and a slot's chunk removed. ``DiskTier.write_many`` cuts the runs and keeps
the bookkeeping."""

from __future__ import annotations

import os

import numpy as np

from kvtier.disk.check import holds_another
from kvtier.disk.parts import ChunkParts
from kvtier.disk.stamps import Stamp
from kvtier.io import codec as codecs
from kvtier.io.format import INDEX_ENTRY_BYTES, Codec, SlotHeader, mark_removed, payload_checksum
from kvtier.io.result import IOResult, IOStatus
from kvtier.io.scratch import ThreadScratch
from kvtier.io.vectored import write_fully
from kvtier.keys import ChunkKey
from kvtier.segment.cachedir import CacheDir, aligned_view


def encode(key: ChunkKey, src: np.ndarray, header_buf: np.ndarray, scratch: ThreadScratch,
           stamp: Stamp, *, ns_digest: bytes, raw_bytes: int, parts: ChunkParts,
           compression: bool, element_bytes: int, record: bytes = b"",
           ) -> tuple[Codec, np.ndarray, int]:
    """(codec, aligned body to write, payload size) of chunk ``key`` from ``src``; the header
    (its generation and time ``stamp``, the chunk's token ``record`` after its part
    table) goes in ``header_buf``, a compressed payload in this thread's payload buffer."""
    raw = src[: raw_bytes]
    codec, payload, body_source = Codec.NONE, raw, src
    if compression:
        packed = codecs.encode(raw, element_bytes)
        if packed is not None:
            codec, blob = packed
            body_source = scratch.payload()
            payload = body_source[: len(blob)]
            payload[:] = np.frombuffer(blob, dtype=np.uint8)
    if codec is Codec.NONE and parts:
        header = parts.header(ns_digest, key, raw, *stamp)
    else:
        header = SlotHeader(ns_digest, key, codec, payload.size, raw_bytes,
                            payload_checksum(payload.data), *stamp)
    header.encode(into=header_buf, record=record)
    return codec, aligned_view(body_source, payload.size), payload.size


def write_run(directory: CacheDir, number: int, offset: int, iov: list, end: int, root: str) -> IOResult:
    """Write ``iov`` at ``offset`` of slot file ``number`` in one vectored call, the file
    first grown to ``end`` bytes: OK with the bytes written, NO_SPACE at the free-space floor
    (of path ``root``), IO_ERROR when the write came short."""
    expected = sum(b.size for b in iov)
    if not directory.ensure_allocated(number, end):
        return IOResult(IOStatus.NO_SPACE, detail=f"{root}: free-space floor reached")
    first, count = number * directory.file_slots + offset // directory.stride, len(iov) // 2
    with directory.slot_locks.held(first, count), directory.held():  # no blank in between
        # the slots' index entries blanked first: a crash (or a write that fails part-way)
        # before the new entries are written must not leave them naming the chunks
        # overwritten, which a restart would take for on disk without reading them
        directory.blank_index(first, count)
        written = write_fully(directory.fd(number), iov, offset)
    if written != expected:
        return IOResult(IOStatus.IO_ERROR, detail=f"short write of {written} bytes")
    return IOResult(IOStatus.OK, written)


def remove_slot(directory: CacheDir, number: int, offset: int, local: int, key: ChunkKey | None,
                ns_digest: bytes, header_buf: np.ndarray) -> bool:
    """Blank slot ``local`` of the segment (at ``offset`` of slot file ``number``) with its
    lock held, through ``header_buf`` (one aligned header); False, and nothing changed, when
    it lies past the end of its file or holds another chunk than ``key`` (``holds_another``).
    Its index entry goes first, and a record in the log, so that readers stop before the
    header changes: the tombstone of the header read (``mark_removed``), so that should a
    kill fall before the header is blanked, ``kvtier verify --repair`` finishes the removal
    rather than index the chunk again. Errors for the caller."""
    with directory.slot_locks.held(local), directory.held():  # no write of it in between
        if directory.file_size(number) <= offset or holds_another(
                directory.fd(number), offset, key, ns_digest, header_buf):
            return False
        mark_removed(header_buf[:INDEX_ENTRY_BYTES].reshape(1, -1))
        directory.write_index(local, header_buf)
        header_buf[:] = 0
        os.pwritev(directory.fd(number), [header_buf.data], offset)
    return True
