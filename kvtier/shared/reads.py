"""Reading chunks out of other writers' segments: read only, verified like every disk read.

Another writer may be overwriting, truncating or deleting the slot being read, or may have
crashed halfway through writing it: the slot's own header (namespace, key, codec, sizes,
its checksum) and the payload checksum decide, so a read racing a writer is CORRUPT (a
miss), never wrong bytes. Nothing in another writer's segment is ever written or blanked.
Which failures prove a copy bad, and which prove nothing: ``kvtier.shared.misreads``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from kvtier.config.settings import KVTierConfig
from kvtier.disk.check import decode_into, slot_problem
from kvtier.disk.parts import ChunkParts
from kvtier.io.format import HEADER_BYTES, Codec
from kvtier.io.result import IOResult, IOStatus
from kvtier.io.safefs import SafeDir
from kvtier.io.scratch import ThreadScratch
from kvtier.io.vectored import RUN_BYTES, read_fully
from kvtier.keys import ChunkKey, Namespace
from kvtier.segment.cachedir import aligned_view
from kvtier.segment.index_file import file_slots_for, open_segment_dir
from kvtier.segment.names import SLOT_FILE
from kvtier.shared.kept_files import KeptFiles
from kvtier.shared.misreads import failed_read, short_read

if TYPE_CHECKING:
    from kvtier.disk.lane import DiskLane, NoDisk

MAX_RUN = 16  # neighbouring slots of one file read in one vectored call


@dataclass(frozen=True)
class SlotRef:
    """Where a chunk sits in another writer's segment (local ``slot`` of its files on disk
    path ``path``) and what the writer's log said of it; ``generation`` counts the restarts
    of that writer's log the reader has seen (its files are reopened when it changes)."""

    writer: str
    path: int
    slot: int
    key: bytes
    codec: int
    payload_bytes: int
    generation: int = 0


class OtherReads:
    """Verified reads of :class:`SlotRef` s into host slots (page-aligned buffers of at
    least ``raw_bytes``); ``o_direct[path]`` says whether to read a path's files with
    O_DIRECT. Results, never exceptions: ``CORRUPT`` (the slot does not hold the chunk) or
    ``MISSING`` (its file gone, or not kvtier's) prove the copy bad; ``IO_ERROR`` (a failed
    or short read) proves nothing (``misreads``). Files are opened through :class:`SafeDir`
    (no symlink followed, regular files of this user with one link) and reopened when a
    reference comes with a new ``generation``, or after a failed or short read (a stale
    handle, or size, stays so: an open looks again). Files read are kept open (``kept``,
    ``KeptFiles``: closed once deleted, swept every ``SWEEP_S`` on a thread of its own, and
    when their segment is no longer followed). Thread-safe."""

    def __init__(self, roots: Sequence[str], namespace: Namespace, raw_bytes: int, stride: int,
                 o_direct: Sequence[bool], parts: ChunkParts | None = None) -> None:
        self._roots, self._ns = list(roots), namespace
        self._parts = parts or ChunkParts(raw_bytes)
        self._digest, self._raw_bytes, self._stride = namespace.digest(), raw_bytes, stride
        self._file_slots = file_slots_for(stride)
        self._o_direct = list(o_direct)
        self._scratch = ThreadScratch(MAX_RUN, HEADER_BYTES, stride, raw_bytes)
        self._max_run = max(1, min(MAX_RUN, RUN_BYTES // stride))  # slots in one call
        self.kept = KeptFiles()

    def read_many(self, items: Sequence[tuple[SlotRef, np.ndarray]]) -> list[IOResult]:
        """Read several chunks (each into its buffer, as ``read``): uncompressed neighbours in
        one file of one writer move in one vectored call, each checked on its own."""
        order = sorted(range(len(items)), key=lambda i: (items[i][0].path, items[i][0].writer,
                                                         items[i][0].slot))
        runs: list[list[int]] = []
        for i in order:
            if runs and len(runs[-1]) < self._max_run and self._follows(items[runs[-1][-1]][0],
                                                                        items[i][0]):
                runs[-1].append(i)
            else:
                runs.append([i])
        results: list[IOResult] = [IOResult(IOStatus.IO_ERROR)] * len(items)
        for run in runs:
            got = [self.read(*items[run[0]])] if len(run) == 1 else self._read_run(
                [items[i] for i in run])
            for i, result in zip(run, got, strict=True):
                results[i] = result
        return results

    def _follows(self, before: SlotRef, ref: SlotRef) -> bool:
        """Whether ``ref`` is the slot right after ``before`` in the same file, both whole
        (uncompressed) payloads: one vectored call reads both."""
        whole = self._raw_bytes
        return ((ref.path, ref.writer, ref.generation) == (before.path, before.writer,
                                                           before.generation)
                and ref.slot == before.slot + 1
                and ref.slot // self._file_slots == before.slot // self._file_slots
                and ref.codec == before.codec == Codec.NONE
                and ref.payload_bytes == before.payload_bytes == whole)

    def _read_run(self, run: list[tuple[SlotRef, np.ndarray]]) -> list[IOResult]:
        first = run[0][0]
        number, offset = divmod(first.slot, self._file_slots)
        headers = self._scratch.headers(len(run))
        landed = [(headers[j * HEADER_BYTES:(j + 1) * HEADER_BYTES], aligned_view(dst, self._raw_bytes))
                  for j, (_, dst) in enumerate(run)]
        try:
            fd = self._fd(first, number)
            try:
                got = read_fully(fd, [b for pair in landed for b in pair], offset * self._stride)
            finally:
                os.close(fd)
        except OSError as exc:
            self._let_go(first, number)
            return [failed_read(exc, first.writer)] * len(run)
        results = []
        for j, ((ref, _), (header_buf, payload)) in enumerate(zip(run, landed, strict=True)):
            arrived = min(max(got - j * self._stride, 0), HEADER_BYTES + payload.size)
            if arrived < HEADER_BYTES + self._raw_bytes:
                results.append(short_read(ref.writer, arrived, HEADER_BYTES + self._raw_bytes))
                continue
            problem = slot_problem(header_buf, ChunkKey(ref.key), [payload], arrived - HEADER_BYTES,
                                   Codec.NONE, self._digest, self._raw_bytes, True)
            results.append(IOResult(IOStatus.CORRUPT, arrived, f"writer {ref.writer}: {problem}")
                           if problem else IOResult(IOStatus.OK, arrived))
        if any(r.status is IOStatus.IO_ERROR for r in results):  # short: opened afresh next
            self._let_go(first, number)
        return results

    def read(self, chunk: SlotRef, dst: np.ndarray) -> IOResult:
        """Read ``chunk`` into ``dst[:raw_bytes]``; CORRUPT leaves ``dst`` junk."""
        number, offset = divmod(chunk.slot, self._file_slots)
        offset *= self._stride
        try:
            codec = Codec(chunk.codec)
        except ValueError:
            return IOResult(IOStatus.CORRUPT, detail=f"writer {chunk.writer}: codec {chunk.codec}")
        compressed = codec is not Codec.NONE
        if not 0 < chunk.payload_bytes <= self._stride - HEADER_BYTES:
            return IOResult(IOStatus.CORRUPT, detail=f"writer {chunk.writer}: payload length")
        buffer = self._scratch.payload() if compressed else dst
        payload = aligned_view(buffer, chunk.payload_bytes)
        header_buf = self._scratch.headers(1)
        try:
            fd = self._fd(chunk, number)  # a duplicate: no other thread closes it under us
            try:
                got = read_fully(fd, [header_buf, payload], offset)
            finally:
                os.close(fd)
        except OSError as exc:
            self._let_go(chunk, number)
            return failed_read(exc, chunk.writer)
        if got < HEADER_BYTES + chunk.payload_bytes:
            self._let_go(chunk, number)
            return short_read(chunk.writer, got, HEADER_BYTES + chunk.payload_bytes)
        problem = slot_problem(header_buf, ChunkKey(chunk.key), [payload], got - HEADER_BYTES,
                               codec, self._digest, self._raw_bytes, True, stored=chunk.payload_bytes)
        if problem:
            return IOResult(IOStatus.CORRUPT, max(got, 0), f"writer {chunk.writer}: {problem}")
        if compressed:
            try:
                decode_into(codec, payload[: chunk.payload_bytes], dst, self._scratch)
            except ValueError as exc:
                return IOResult(IOStatus.CORRUPT, got, f"writer {chunk.writer}: {exc}")
        return IOResult(IOStatus.OK, got)

    def read_parts(self, chunk: SlotRef, dst: np.ndarray, wanted: Collection[int]) -> IOResult:
        """Read and verify only parts ``wanted`` of ``chunk`` into ``dst``, at their places
        in the chunk (``DiskTier.read_parts``); the whole chunk where they cannot be read
        alone, or it was stored compressed."""
        if not self._parts.reads_alone(wanted) or chunk.codec != Codec.NONE:
            return self.read(chunk, dst)
        number, offset = divmod(chunk.slot, self._file_slots)
        header_buf = self._scratch.headers(1)
        arrived = 0
        try:
            fd = self._fd(chunk, number)
            try:
                for start, iov in self._parts.runs(header_buf, dst, wanted):
                    asked = sum(b.size for b in iov)
                    got = read_fully(fd, iov, offset * self._stride + start)
                    arrived += got
                    if got < asked:
                        self._let_go(chunk, number)
                        return short_read(chunk.writer, arrived, arrived - got + asked)
            finally:
                os.close(fd)
        except OSError as exc:
            self._let_go(chunk, number)
            return failed_read(exc, chunk.writer)
        problem = slot_problem(header_buf, ChunkKey(chunk.key), [dst], self._raw_bytes,
                               Codec.NONE, self._digest, self._raw_bytes, True,
                               wanted=self._parts.read_map(wanted))
        return (IOResult(IOStatus.CORRUPT, arrived, f"writer {chunk.writer}: {problem}")
                if problem else IOResult(IOStatus.OK, arrived))

    def _fd(self, chunk: SlotRef, number: int) -> int:
        return self.kept.get((chunk.path, chunk.writer, number), chunk.generation,
                             lambda: self._open(chunk, number))

    def _let_go(self, chunk: SlotRef, number: int) -> None:
        """Close the kept file ``number`` of ``chunk``'s writer: the next read opens it."""
        self.kept.let_go((chunk.path, chunk.writer, number))

    def _open(self, chunk: SlotRef, number: int) -> int:
        if chunk.path >= len(self._roots):
            raise OSError(errno.ENOENT, f"no disk path {chunk.path}")
        flags = os.O_RDONLY | (os.O_DIRECT if self._o_direct[chunk.path] else 0)
        directory: SafeDir = open_segment_dir(self._roots[chunk.path], self._ns.id, chunk.writer)
        with directory:
            return cast(int, directory.open_file(SLOT_FILE.format(number), flags))

    def close(self) -> None:
        self.kept.close()


def other_reads(config: KVTierConfig, namespace: Namespace, raw_bytes: int,
                  lane: DiskLane | NoDisk) -> OtherReads | None:
    """A reader of other writers' chunks for ``lane``'s paths (read the way the lane's own
    files are: O_DIRECT where it probed so), or None: no disk tier, or ``share_refresh`` off."""
    tier = lane.tier
    if config.share_refresh is None or tier is None:
        return None
    o_direct = [p.dir.o_direct if p.dir is not None else False for p in tier.paths.states]
    return OtherReads(config.disk_paths, namespace, raw_bytes, tier.stride, o_direct, tier.parts)
