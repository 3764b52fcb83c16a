"""The disk tier's reads, apart from its writes: where each slot of a vectored run lands, the
run read in one call, and what each slot brought, checked (and decoded when it was stored
compressed). ``DiskTier.read_many`` cuts the runs and answers for the paths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtier.disk.check import decode_into, slot_problem
from kvtier.io.format import HEADER_BYTES, Codec
from kvtier.io.result import IOResult, IOStatus
from kvtier.io.scratch import ThreadScratch
from kvtier.io.vectored import read_fully
from kvtier.keys import ChunkKey
from kvtier.segment.cachedir import CacheDir, aligned_view

if TYPE_CHECKING:
    pass  # collections.abc.Buffer from Python 3.12

# where a chunk read lands: one buffer, or pieces its payload is scattered over in order
Target = np.ndarray | list[np.ndarray]
# where one slot of a run lands: its header buffer, its payload's buffers, their size
Landing = tuple[np.ndarray, list[np.ndarray], int]


def landing(run: list[int], items: Sequence[tuple[int, ChunkKey, Target]], compressed: set[int],
            scratch: ThreadScratch, lengths: np.ndarray, raw_bytes: int) -> list[Landing]:
    """Where each slot of ``run`` (indexes into ``items``) lands: (its header buffer, its
    payload's buffers, their size); a compressed payload (``compressed``: those indexes;
    ``lengths``: each slot's payload bytes) goes to this thread's payload buffer first."""
    headers = scratch.headers(len(run))
    landed = []
    for j, i in enumerate(run):
        slot, _, dst = items[i]
        header_buf = headers[j * HEADER_BYTES:(j + 1) * HEADER_BYTES]
        if isinstance(dst, list) and i not in compressed:
            landed.append((header_buf, dst, raw_bytes))  # pieces: the raw bytes exactly
            continue
        buffer = scratch.payload() if i in compressed else dst
        assert isinstance(buffer, np.ndarray), "a compressed slot reads into one buffer"
        payload = aligned_view(buffer, int(lengths[slot]) or raw_bytes)
        landed.append((header_buf, [payload], payload.size))
    return landed


def read_run(directory: CacheDir, number: int, offset: int, landed: list[Landing],
             stride: int) -> list[int]:
    """Read the slots of a run (``stride`` bytes apart from ``offset`` of slot file
    ``number``) in one vectored call into where each lands; return the bytes of each (header
    and payload) that arrived."""
    iov = [buffer for header_buf, payload, _ in landed for buffer in (header_buf, *payload)]
    with directory.held():
        got = read_fully(directory.fd(number), iov, offset)
    return [min(max(got - j * stride, 0), HEADER_BYTES + size)
            for j, (_, _, size) in enumerate(landed)]


def read_part_runs(directory: CacheDir, number: int, offset: int,
                   runs: list[tuple[int, list[np.ndarray]]]) -> IOResult:
    """Read ``runs`` of the slot at ``offset`` of file ``number`` (each: where it starts in
    the slot, the buffers it fills: ``ChunkParts.runs``), one vectored call each: OK with the
    bytes that arrived, or CORRUPT at the first run that came short."""
    arrived = 0
    for start, iov in runs:
        with directory.held():
            got = read_fully(directory.fd(number), iov, offset + start)
        arrived += got
        if got < sum(b.size for b in iov):
            return IOResult(IOStatus.CORRUPT, arrived, "slot truncated")
    return IOResult(IOStatus.OK, arrived)


def checked(key: ChunkKey, dst: Target, codec: Codec, stored: int, landed: Landing, arrived: int,
            scratch: ThreadScratch, *, ns_digest: bytes, raw_bytes: int,
            verify_payload: bool) -> IOResult:
    """What a slot read into ``landed`` brought (``arrived`` bytes): OK when it holds chunk
    ``key`` of namespace ``ns_digest`` as written with ``codec`` (``stored`` payload bytes),
    its payload decoded into ``dst`` when compressed; else CORRUPT, ``dst`` junk."""
    header_buf, payload, _ = landed
    problem = slot_problem(header_buf, key, payload, arrived - HEADER_BYTES, codec,
                           ns_digest, raw_bytes, verify_payload, stored=stored)
    if problem:
        return IOResult(IOStatus.CORRUPT, arrived, problem)
    if codec is not Codec.NONE:
        try:
            decode_into(codec, payload[0][:stored], dst, scratch)
        except ValueError as exc:
            return IOResult(IOStatus.CORRUPT, arrived, str(exc))
    return IOResult(IOStatus.OK, arrived)
