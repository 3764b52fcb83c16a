"""The cold tier: fixed-size slots in large preallocated files on one or more disk paths.

Slot ``s`` lives on path ``s % P`` (chunks stripe across drives), in that path's slot
files. A slot is a 4 KiB header and the payload, read and written with one vectored call.
A chunk of a hybrid model is written in parts (one per KV cache group, ``parts``), each
checked on its own, so that a load needing only some groups reads only their parts
(``read_parts``). This class moves and checks bytes only (``kvtier.disk.reads`` and
``kvtier.disk.writes`` hold the reads' and the writes' own steps); which chunk goes in which
slot is the bookkeeping's business (``SlotIndex`` under the ``TierStack``). Every method here
blocks: the owner runs them on the I/O engine's threads (queue ``queue_of(slot)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvtier.config.settings import DiskFloor
from kvtier.disk.check import slot_problem
from kvtier.disk.opening import OpenArgs
from kvtier.disk.parts import ChunkParts
from kvtier.disk.paths import DiskPaths, PathState
from kvtier.disk.reads import Target, checked, landing, read_part_runs, read_run
from kvtier.disk.recovery import DiskRecovery, RecoveredSlot, RecoveryReport  # noqa: F401
from kvtier.disk.stamps import WriteStamps
from kvtier.disk.writes import encode, remove_slot, write_run
from kvtier.io.format import HEADER_BYTES, Codec, SlotHeader
from kvtier.io.result import IOResult, IOStatus
from kvtier.io.scratch import ThreadScratch
from kvtier.keys import ChunkKey, Namespace
from kvtier.segment.cachedir import CacheDir
from kvtier.segment.index_file import SlotLayout
from kvtier.segment.lease import beat_every
from kvtier.segment.names import writer_ids
from kvtier.tiers.base import TierName

_HEALTH_EVERY_S = 1.0  # how often a path's directory is checked; read when a tier opens
MAX_RUN = 16  # slots per vectored call
IOV_MAX = 1024  # buffers per vectored call (Linux)


class DiskTier:
    """Slots of ``stride`` bytes striped over ``paths``; see the module docstring.

    Contract: ``write`` makes a slot hold a chunk (header last-writer-wins); ``read`` returns
    OK only when the header names this namespace and key and the payload checksum matches,
    so a torn, stale, foreign or flipped slot is CORRUPT and never yields bytes; errors come
    back as an :class:`IOResult`, never as exceptions; a path that fails for good goes down
    (``down_paths``) and every later request to it is PATH_DOWN.
    """

    name = TierName.DISK

    def __init__(self, paths: Sequence[str], namespace: Namespace, raw_bytes: int,
                 capacity: int, *, compression: bool = False, element_bytes: int = 2,
                 o_direct: bool | None = None, floor: DiskFloor | None = None,
                 retry: float | None = 30.0, verify_payload: bool = True,
                 writers: Sequence[str] | None = None, lease_timeout: float = 120.0,
                 share_writers: int = 1, parts: Sequence[int] = (),
                 answer_timeout: float | None = 10.0) -> None:
        if not paths:
            raise ValueError("DiskTier needs at least one path")
        self.namespace, self.ns_digest = namespace, namespace.digest()
        self.raw_bytes = raw_bytes
        self.parts = ChunkParts(raw_bytes, parts)
        self.compression, self.element_bytes = compression, element_bytes
        self.verify_payload = verify_payload  # False only to measure what verifying costs
        self.layout = SlotLayout(raw_bytes, len(paths), capacity)
        self.layout.check_bounded()
        self.stride = self.layout.stride
        self.num_slots = self.layout.num_slots
        self.file_slots = self.layout.file_slots
        meta = {"namespace": namespace.canonical_json(), "stride": self.stride,
                "raw_bytes": raw_bytes, "file_slots": self.file_slots}
        writers = tuple(writers or writer_ids(None))
        opener = OpenArgs(namespace.id, writers, meta, num_slots=self.layout.per_path,
                          stride=self.stride, file_slots=self.file_slots, o_direct=o_direct,
                          floor=floor or DiskFloor(), share_writers=share_writers,
                          lease_timeout=lease_timeout, answer_timeout=answer_timeout)
        self._health = DiskPaths(paths, retry, opener, _HEALTH_EVERY_S, beat_every(lease_timeout))
        self._paths = self._health.states  # the same list: one state per path
        self._recovery = DiskRecovery(self._health, self.ns_digest, self.layout, answer_timeout)
        self._lengths = np.zeros(self.num_slots, dtype=np.uint32)  # payload <= MAX_RAW_BYTES
        self._codecs = np.zeros(self.num_slots, dtype=np.uint8)
        self.stamps = WriteStamps()  # each write's generation and time (``reserve`` a slot's)
        self._scratch = ThreadScratch(MAX_RUN, HEADER_BYTES, self.stride, raw_bytes)

    # -- layout -------------------------------------------------------------------------

    @property
    def queues(self) -> list[str]:
        return [f"disk{i}" for i in range(len(self._paths))]

    def queue_of(self, slot: int) -> str:
        return f"disk{slot % len(self._paths)}"

    def slots_of_path(self, index: int) -> range:
        return range(index, self.num_slots, len(self._paths))

    @property
    def roots(self) -> list[str]:
        return [p.root for p in self._paths]

    @property
    def writer(self) -> str:
        """This tier's writer id: its segment's name on every path; while no path has
        opened, the id where its search for one stopped, no segment of its own
        (``paths.own``)."""
        return self._health.writer

    @property
    def paths(self) -> DiskPaths:
        """Each path's state and health (``paths[i].dir``, ``paths[i].retry_every``, ...)."""
        return self._health

    @property
    def down_paths(self) -> dict[int, str]:
        """Paths out of service by index, with the reason."""
        return self._health.down

    @property
    def o_direct(self) -> dict[str, bool]:
        return {p.root: p.dir.o_direct for p in self._paths if p.dir is not None}

    def _where(self, slot: int) -> tuple[PathState, CacheDir | None, int, int]:
        """A slot's path, that path's open directory now (None when out of service: another
        thread may take it down at any time, so callers use this one), file and offset."""
        path = self._paths[slot % len(self._paths)]
        directory = path.dir
        number, offset = directory.locate(slot // len(self._paths)) if directory else (0, 0)
        return path, directory, number, offset

    # -- I/O ----------------------------------------------------------------------------

    def write(self, slot: int, key: ChunkKey, src: np.ndarray) -> IOResult:
        """Write chunk ``key`` from ``src`` (a page-aligned uint8 buffer of >= raw bytes)."""
        return self.write_many([(slot, key, src)])[0]

    def read(self, slot: int, key: ChunkKey, dst: np.ndarray) -> IOResult:
        """Read chunk ``key`` into ``dst[:raw_bytes]``, verified; CORRUPT leaves ``dst`` junk."""
        return self.read_many([(slot, key, dst)])[0]

    def write_many(self, items: Sequence[tuple[int, ChunkKey, np.ndarray]],
                   records: Mapping[ChunkKey, bytes] | None = None) -> list[IOResult]:
        """Write several chunks, each with its token record (``records``) where there is
        one; slots adjacent in one file go in one vectored call."""
        results: list[IOResult] = [IOResult(IOStatus.IO_ERROR)] * len(items)
        for run in self.layout.runs([slot for slot, _, _ in items], 1 if self.compression else MAX_RUN):
            path, directory, number, offset = self._where(items[run[0]][0])
            if directory is None or not self._health.healthy(path, directory):
                for i in run:
                    results[i] = IOResult(IOStatus.PATH_DOWN, detail=path.down_reason)
                continue
            headers = self._scratch.headers(len(run))
            iov, sizes = [], []
            for j, i in enumerate(run):
                slot, key, src = items[i]
                header_buf = headers[j * HEADER_BYTES:(j + 1) * HEADER_BYTES]
                codec, body, size = encode(key, src, header_buf, self._scratch, self.stamps.of(slot),
                                           ns_digest=self.ns_digest, raw_bytes=self.raw_bytes,
                                           parts=self.parts, compression=self.compression,
                                           element_bytes=self.element_bytes,
                                           record=records.get(key, b"") if records else b"")
                iov += [header_buf, body]
                sizes.append((slot, codec, size, header_buf))
            for i, result in zip(run, self._write_run(path, directory, number, offset, iov, sizes),
                                 strict=True):
                results[i] = result
        return results

    def _write_run(self, path: PathState, directory: CacheDir, number: int, offset: int, iov: list,
                   sizes: list) -> list[IOResult]:
        try:
            done = write_run(directory, number, offset, iov, offset + len(sizes) * self.stride, path.root)
            if not done.ok:
                return [done] * len(sizes)
            for slot, codec, size, header_buf in sizes:
                self._lengths[slot], self._codecs[slot] = size, codec
                directory.write_index(slot // len(self._paths), header_buf)
                self.stamps.written(slot)
        except OSError as exc:
            return [self._health.failed(path, exc, directory)] * len(sizes)
        path.eio_run = 0
        return [IOResult(IOStatus.OK, done.nbytes // len(sizes))] * len(sizes)

    def read_many(self, items: Sequence[tuple[int, ChunkKey, Target]]) -> list[IOResult]:
        """Read and verify several chunks; slots adjacent in one file go in one call.

        A target is one buffer (a host slot: at least the raw bytes, page-aligned) or a list
        of pieces the payload is scattered over in order (exactly the raw bytes; each piece
        page-aligned when the path is O_DIRECT); a CORRUPT result leaves it junk."""
        results: list[IOResult] = [IOResult(IOStatus.IO_ERROR)] * len(items)
        compressed = {i for i, (slot, _, _) in enumerate(items) if self._codecs[slot]}
        pieces = max(len(t) if isinstance(t, list) else 1 for _, _, t in items) if items else 1
        max_run = 1 if compressed else max(1, min(MAX_RUN, IOV_MAX // (1 + pieces)))
        for run in self.layout.runs([slot for slot, _, _ in items], max_run):
            path, directory, number, offset = self._where(items[run[0]][0])
            if directory is None:
                for i in run:
                    results[i] = IOResult(IOStatus.PATH_DOWN, detail=path.down_reason)
                continue
            landed = landing(run, items, compressed, self._scratch, self._lengths, self.raw_bytes)
            try:
                arrivals = read_run(directory, number, offset, landed, self.stride)
            except OSError as exc:
                if len(run) > 1 and not self._health.is_path_error(exc):
                    # one bad sector must not fail its neighbours: read them one by one
                    for i in run:
                        results[i] = self.read_many([items[i]])[0]
                else:
                    results[run[0]] = self._health.failed(path, exc, directory)
                    for i in run[1:]:
                        results[i] = results[run[0]]
                continue
            path.eio_run = 0
            for i, landed_slot, arrived in zip(run, landed, arrivals, strict=True):
                slot, key, dst = items[i]
                results[i] = checked(key, dst, Codec(self._codecs[slot]), int(self._lengths[slot]),
                                     landed_slot, arrived, self._scratch, ns_digest=self.ns_digest,
                                     raw_bytes=self.raw_bytes, verify_payload=self.verify_payload)
        return results

    def read_parts(self, items: Sequence[tuple[int, ChunkKey, np.ndarray, Sequence[int]]]
                   ) -> list[IOResult]:
        """Read and verify parts ``wanted`` (their indexes in ``parts``) of each chunk into
        its host slot, at their places in the chunk, and nothing else of it (the rest of
        the slot is left as it was). A chunk stored compressed, or in parts that cannot be
        read alone (not on page bounds), is read whole."""
        return [self._read_parts(slot, key, dst, set(wanted))
                if self.parts.reads_alone(wanted) and not self._codecs[slot]
                else self.read_many([(slot, key, dst)])[0] for slot, key, dst, wanted in items]

    def _read_parts(self, slot: int, key: ChunkKey, dst: np.ndarray, wanted: set[int]) -> IOResult:
        path, directory, number, offset = self._where(slot)
        if directory is None:
            return IOResult(IOStatus.PATH_DOWN, detail=path.down_reason)
        header_buf = self._scratch.headers(1)
        try:
            read = read_part_runs(directory, number, offset, self.parts.runs(header_buf, dst, wanted))
        except OSError as exc:
            return self._health.failed(path, exc, directory)
        if not read.ok:
            return read
        path.eio_run = 0
        problem = slot_problem(header_buf, key, [dst], self.raw_bytes, Codec.NONE, self.ns_digest,
                               self.raw_bytes, self.verify_payload,
                               wanted=self.parts.read_map(wanted))
        return IOResult(IOStatus.CORRUPT, read.nbytes, problem) if problem else read

    def invalidate(self, slot: int, key: ChunkKey | None = None) -> IOResult:
        """Blank a slot's header (no restart finds it; its index entry first, made a
        tombstone: ``remove_slot``); with ``key``, not if it holds another."""
        path, directory, number, offset = self._where(slot)
        if directory is None:
            return IOResult(IOStatus.OK)
        header_buf, local = self._scratch.headers(1), slot // len(self._paths)
        try:
            if not remove_slot(directory, number, offset, local, key, self.ns_digest, header_buf):
                return IOResult(IOStatus.OK)
        except OSError as exc:
            return self._health.failed(path, exc, directory)
        return IOResult(IOStatus.OK, HEADER_BYTES)

    # -- paths and recovery -------------------------------------------------------------

    def note_timeout(self, slot: int) -> bool:
        """A request on ``slot``'s path got no answer within the owner's time limit: it counts
        as an I/O error towards taking the path out. True when the path went down."""
        return self._health.note_timeout(slot % len(self._paths))

    def revive_due(self) -> list[int]:
        """Indexes of paths out of service whose next try is due (no I/O: cheap to call)."""
        return self._health.revive_due()

    def revive(self, index: int) -> bool:
        """Try to bring path ``index`` back (blocking: run it on the path's queue); True when
        it is back in service, its slots empty to the bookkeeping. See :class:`DiskRetries`."""
        return self._health.revive(index)

    def recover(self, threads: int = 8, path: int | None = None) -> RecoveryReport:
        """Rebuild the slot map: from each path's index file, or by scanning slot headers
        (``threads`` at a time) where the index is missing. Newest copy of each key wins.
        With ``path``: that path's alone, while the tier runs (its slots unused till then)."""
        report = self._recovery.recover(threads, path)
        last_generation = max((r.header.generation for r in report.slots), default=0)
        (self.stamps.restart if path is None else self.stamps.past)(last_generation)
        for recovered in report.slots:
            self._lengths[recovered.slot] = recovered.header.payload_bytes
            self._codecs[recovered.slot] = recovered.header.codec
        return report

    def scan_headers(self, slots: list[int] | range,
                     threads: int = 8) -> tuple[list[tuple[int, SlotHeader]], int, int]:
        """(valid headers, slots scanned, bad slots) read from the slots themselves."""
        return self._recovery.scan_headers(slots, threads)

    def close(self) -> None:
        self._health.close()

