"""The cold tier: fixed-size slots in large preallocated files on one or more disk paths.

Slot ``s`` lives on path ``s % P`` (chunks stripe across drives), in that path's slot
files. A slot is a 4 KiB header and the payload, read and written with one vectored call.
This class moves and checks bytes only; which chunk goes in which slot is the bookkeeping's
business (``SlotIndex`` under the ``TierStack``). Every method here blocks: the owner runs
them on the I/O engine's threads (queue ``queue_of(slot)``).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from kvtier.config import DiskFloor
from kvtier.io import codec as codecs
from kvtier.io.buffers import AlignedBuffer
from kvtier.io.cachedir import CacheDir, aligned_view
from kvtier.io.format import (
    HEADER_BYTES,
    Codec,
    HeaderError,
    SlotHeader,
    decode_header,
    payload_checksum,
)
from kvtier.io.index_file import SlotLayout
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.tiers.base import TierName
from kvtier.tiers.disk_recovery import DiskRecovery, RecoveredSlot, RecoveryReport  # noqa: F401

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

log = logging.getLogger(__name__)

_PATH_FATAL = {errno.EROFS, errno.ENOENT, errno.EACCES, errno.EPERM, errno.EBADF, errno.ENODEV,
               errno.ENXIO, errno.ESTALE, errno.ENOTDIR}
_EIO_LIMIT = 3  # consecutive I/O errors that take a path out of service
_HEALTH_EVERY_S = 1.0
_RETRY_MAX_S = 600.0  # the longest wait between two tries of a path out of service
MAX_RUN = 16  # slots per vectored call


@dataclass(frozen=True)
class _OpenArgs:
    """What every ``CacheDir`` of this tier is opened with, besides its root."""

    namespace_id: str
    meta: dict[str, object]
    num_slots: int
    stride: int
    file_slots: int
    o_direct: bool | None
    floor: DiskFloor


class _Path:
    """One disk path's state: its directory (or why it is out of service) and health."""

    def __init__(self, root: str, retry: float | None) -> None:
        self.root = root
        self.dir: CacheDir | None = None
        self.down_reason = ""
        self.eio_run = 0
        self.inode = 0
        self.checked_at = 0.0
        self.stale: CacheDir | None = None  # taken down; closed before the path is reopened
        self.retry_at = 0.0
        self.retry_every = retry  # None: never tried again
        self.retry_first = retry
        self.back_at = 0.0  # when it last came back into service


class DiskTier(DiskRecovery):
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
                 retry: float | None = 30.0, verify_payload: bool = True) -> None:
        if not paths:
            raise ValueError("DiskTier needs at least one path")
        self.namespace, self.ns_digest = namespace, namespace.digest()
        self.raw_bytes = raw_bytes
        self.compression, self.element_bytes = compression, element_bytes
        self.verify_payload = verify_payload  # False only to measure what verifying costs
        self._paths = [_Path(p, retry) for p in paths]
        self._down_lock = threading.Lock()  # I/O threads may find a path failing together
        self.layout = SlotLayout(raw_bytes, len(paths), capacity)
        self.layout.check_bounded()
        self.stride = self.layout.stride
        per_path = self.layout.per_path
        self.num_slots = self.layout.num_slots
        self.file_slots = self.layout.file_slots
        meta = {"namespace": namespace.canonical_json(), "stride": self.stride,
                "raw_bytes": raw_bytes, "file_slots": self.file_slots}
        self._open_args = _OpenArgs(namespace.id, meta, num_slots=per_path, stride=self.stride,
                                    file_slots=self.file_slots, o_direct=o_direct,
                                    floor=floor or DiskFloor())
        for path in self._paths:
            try:
                path.dir, path.inode = self._open(path)
            except OSError as exc:
                self._take_down(path, f"cannot open: {exc}")
        self._lengths = np.zeros(self.num_slots, dtype=np.uint32)  # payload <= MAX_RAW_BYTES
        self._codecs = np.zeros(self.num_slots, dtype=np.uint8)
        self._generation = itertools.count(time.time_ns())
        self._local = threading.local()

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
    def down_paths(self) -> dict[int, str]:
        """Paths out of service by index, with the reason."""
        return {i: p.down_reason for i, p in enumerate(self._paths) if p.dir is None}

    @property
    def o_direct(self) -> dict[str, bool]:
        return {p.root: p.dir.o_direct for p in self._paths if p.dir is not None}

    def _where(self, slot: int) -> tuple[_Path, CacheDir | None, int, int]:
        """A slot's path, that path's open directory now (None when out of service: another
        thread may take it down at any time, so callers use this one), file and offset."""
        path = self._paths[slot % len(self._paths)]
        directory = path.dir
        number, offset = directory.locate(slot // len(self._paths)) if directory else (0, 0)
        return path, directory, number, offset

    def _header_buffer(self) -> np.ndarray:
        """This thread's aligned buffer for one header."""
        return self._header_buffers(1)

    def _header_buffers(self, count: int) -> np.ndarray:
        """This thread's aligned buffer for ``count`` headers (at most ``MAX_RUN``)."""
        if not hasattr(self._local, "header"):
            self._local.header = AlignedBuffer(MAX_RUN * HEADER_BYTES, pin=False)
        return self._local.header.array[: count * HEADER_BYTES]

    def _payload_buffer(self) -> np.ndarray:
        """This thread's aligned buffer for compressed payloads."""
        if not hasattr(self._local, "payload"):
            self._local.payload = AlignedBuffer(self.stride, pin=False)
        return self._local.payload.array

    # -- I/O ----------------------------------------------------------------------------

    def write(self, slot: int, key: ChunkKey, src: np.ndarray) -> IOResult:
        """Write chunk ``key`` from ``src`` (a page-aligned uint8 buffer of >= raw bytes)."""
        return self.write_many([(slot, key, src)])[0]

    def read(self, slot: int, key: ChunkKey, dst: np.ndarray) -> IOResult:
        """Read chunk ``key`` into ``dst[:raw_bytes]``, verified; CORRUPT leaves ``dst`` junk."""
        return self.read_many([(slot, key, dst)])[0]

    def write_many(self, items: Sequence[tuple[int, ChunkKey, np.ndarray]]) -> list[IOResult]:
        """Write several chunks; slots adjacent in one file go in one vectored call."""
        results: list[IOResult] = [IOResult(IOStatus.IO_ERROR)] * len(items)
        for run in self._runs([slot for slot, _, _ in items], single=self.compression):
            path, directory, number, offset = self._where(items[run[0]][0])
            if directory is None or not self._healthy(path, directory):
                for i in run:
                    results[i] = IOResult(IOStatus.PATH_DOWN, detail=path.down_reason)
                continue
            headers = self._header_buffers(len(run))
            iov, sizes = [], []
            for j, i in enumerate(run):
                slot, key, src = items[i]
                header_buf = headers[j * HEADER_BYTES:(j + 1) * HEADER_BYTES]
                codec, body, size = self._encode(key, src, header_buf)
                iov += [header_buf, body]
                sizes.append((slot, codec, size, header_buf))
            for i, result in zip(run, self._write_run(path, directory, number, offset, iov, sizes),
                                 strict=True):
                results[i] = result
        return results

    def _encode(self, key: ChunkKey, src: np.ndarray, header_buf: np.ndarray):
        """(codec, aligned body to write, payload size); the header goes in ``header_buf``."""
        raw = src[: self.raw_bytes]
        codec, payload, body_source = Codec.NONE, raw, src
        if self.compression:
            packed = codecs.encode(raw, self.element_bytes)
            if packed is not None:
                codec, blob = packed
                body_source = self._payload_buffer()
                payload = body_source[: len(blob)]
                payload[:] = np.frombuffer(blob, dtype=np.uint8)
        SlotHeader(self.ns_digest, key, codec, payload.size, self.raw_bytes,
                   payload_checksum(payload.data), next(self._generation), time.time_ns()
                   ).encode(into=header_buf)
        return codec, aligned_view(body_source, payload.size), payload.size

    def _write_run(self, path: _Path, directory: CacheDir, number: int, offset: int, iov: list,
                   sizes: list) -> list[IOResult]:
        expected = sum(b.size for b in iov)
        try:
            if not directory.ensure_allocated(number, offset + len(sizes) * self.stride):
                failed = IOResult(IOStatus.NO_SPACE, detail=f"{path.root}: free-space floor reached")
                return [failed] * len(sizes)
            written = os.pwritev(directory.fd(number), iov, offset)
            if written != expected:
                return [IOResult(IOStatus.IO_ERROR, detail=f"short write of {written} bytes")] * len(sizes)
            for slot, codec, size, header_buf in sizes:
                self._lengths[slot], self._codecs[slot] = size, codec
                directory.write_index(slot // len(self._paths), header_buf)
        except OSError as exc:
            return [self._failed(path, exc, directory)] * len(sizes)
        path.eio_run = 0
        return [IOResult(IOStatus.OK, written // len(sizes))] * len(sizes)

    def read_many(self, items: Sequence[tuple[int, ChunkKey, np.ndarray]]) -> list[IOResult]:
        """Read and verify several chunks; slots adjacent in one file go in one call."""
        results: list[IOResult] = [IOResult(IOStatus.IO_ERROR)] * len(items)
        compressed = {i for i, (slot, _, _) in enumerate(items) if self._codecs[slot]}
        for run in self._runs([slot for slot, _, _ in items], single=bool(compressed)):
            path, directory, number, offset = self._where(items[run[0]][0])
            if directory is None:
                for i in run:
                    results[i] = IOResult(IOStatus.PATH_DOWN, detail=path.down_reason)
                continue
            headers = self._header_buffers(len(run))
            iov: list[np.ndarray] = []
            for j, i in enumerate(run):
                slot, _, dst = items[i]
                length = int(self._lengths[slot]) or self.raw_bytes
                buffer = dst if i not in compressed else self._payload_buffer()
                iov += [headers[j * HEADER_BYTES:(j + 1) * HEADER_BYTES], aligned_view(buffer, length)]
            try:
                got = os.preadv(directory.fd(number), cast("list[Buffer]", iov), offset)
            except OSError as exc:
                for i in run:
                    results[i] = self._failed(path, exc, directory)
                continue
            path.eio_run = 0
            for j, i in enumerate(run):
                arrived = min(max(got - j * self.stride, 0), HEADER_BYTES + iov[2 * j + 1].size)
                results[i] = self._verify(items[i], iov[2 * j], iov[2 * j + 1], arrived)
        return results

    def _verify(self, item: tuple[int, ChunkKey, np.ndarray], header_buf: np.ndarray,
                target: np.ndarray, arrived: int) -> IOResult:
        slot, key, dst = item
        codec = Codec(self._codecs[slot])
        problem = self._check(header_buf, key, target, arrived - HEADER_BYTES, codec)
        if problem:
            return IOResult(IOStatus.CORRUPT, arrived, problem)
        if codec is not Codec.NONE:
            try:
                codecs.decode(codec, target[: int(self._lengths[slot])].data, dst[: self.raw_bytes])
            except ValueError as exc:
                return IOResult(IOStatus.CORRUPT, arrived, str(exc))
        return IOResult(IOStatus.OK, arrived)

    def _runs(self, slots: list[int], single: bool) -> list[list[int]]:
        """Indexes of ``slots`` grouped into runs of neighbours in one file (sorted)."""
        order = sorted(range(len(slots)), key=lambda i: slots[i])
        runs: list[list[int]] = []
        paths = len(self._paths)
        for i in order:
            last = runs[-1] if runs else None
            if (not single and last is not None and len(last) < MAX_RUN
                    and slots[i] == slots[last[-1]] + paths
                    and (slots[i] // paths) // self.file_slots
                    == (slots[last[-1]] // paths) // self.file_slots):
                last.append(i)
            else:
                runs.append([i])
        return runs

    def _check(self, header_buf: np.ndarray, key: ChunkKey, payload: np.ndarray, got: int,
               codec: Codec) -> str:
        try:
            header = decode_header(header_buf.data)
        except HeaderError as exc:
            return str(exc)
        if header.namespace != self.ns_digest or header.key != key:
            return "slot holds another chunk (stale or foreign)"
        if header.codec is not codec or header.raw_bytes != self.raw_bytes:
            return "slot header does not match what was written"
        if got < header.payload_bytes:
            return f"payload truncated: {max(got, 0)} of {header.payload_bytes} bytes"
        stored = payload[: header.payload_bytes]
        if self.verify_payload and payload_checksum(stored.data) != header.payload_checksum:
            return "payload checksum mismatch"
        return ""

    def invalidate(self, slot: int) -> IOResult:
        """Blank a slot's header so the chunk is not found again after a restart."""
        path, directory, number, offset = self._where(slot)
        if directory is None:
            return IOResult(IOStatus.OK)
        header_buf = self._header_buffer()
        header_buf[:] = 0
        try:
            if directory.file_size(number) <= offset:
                return IOResult(IOStatus.OK)
            directory.write_index(slot // len(self._paths), header_buf)
            os.pwritev(directory.fd(number), [header_buf.data], offset)
        except OSError as exc:
            return self._failed(path, exc, directory)
        return IOResult(IOStatus.OK, HEADER_BYTES)

    # -- health -------------------------------------------------------------------------

    def _failed(self, path: _Path, exc: OSError, directory: CacheDir) -> IOResult:
        """The result of a request that failed with ``exc`` on ``directory`` (the path's
        directory when the request started: a failure of a directory already replaced by
        a revive says nothing about the new one)."""
        if exc.errno == errno.ENOSPC:
            return IOResult(IOStatus.NO_SPACE, detail=f"{path.root}: {exc}")
        if path.dir is not directory:
            return IOResult(IOStatus.IO_ERROR, detail=f"{path.root}: {exc} (before the path "
                            "was taken out or tried again)")
        if exc.errno in _PATH_FATAL:
            self._take_down(path, str(exc), directory)
            return IOResult(IOStatus.PATH_DOWN, detail=path.down_reason)
        path.eio_run += 1
        if path.eio_run >= _EIO_LIMIT:
            self._take_down(path, f"{_EIO_LIMIT} I/O errors in a row, last: {exc}", directory)
            return IOResult(IOStatus.PATH_DOWN, detail=path.down_reason)
        return IOResult(IOStatus.IO_ERROR, detail=f"{path.root}: {exc}")

    def note_timeout(self, slot: int) -> bool:
        """A request on ``slot``'s path got no answer within the owner's time limit: it counts
        as an I/O error towards taking the path out. True when the path went down."""
        path = self._paths[slot % len(self._paths)]
        directory = path.dir
        if directory is None:
            return False
        path.eio_run += 1
        if path.eio_run < _EIO_LIMIT:
            return False
        self._take_down(path, f"{_EIO_LIMIT} requests in a row failed or got no answer in time",
                        directory)
        return path.dir is None

    def _open(self, path: _Path) -> tuple[CacheDir, int]:
        args = self._open_args
        directory = CacheDir(Path(path.root), args.namespace_id, args.meta, num_slots=args.num_slots,
                             stride=args.stride, file_slots=args.file_slots,
                             o_direct=args.o_direct, floor=args.floor)
        try:
            return directory, directory.inode
        except OSError:
            directory.close()
            raise

    def _healthy(self, path: _Path, directory: CacheDir) -> bool:
        """Its directory (checked once a second) still the one opened."""
        now = time.monotonic()
        if now - path.checked_at >= _HEALTH_EVERY_S:
            path.checked_at = now
            try:
                inode = os.stat(directory.path, follow_symlinks=False).st_ino
            except OSError as exc:
                inode = -1
                reason = f"directory gone: {exc}"
            else:
                reason = "directory replaced"
            if inode != path.inode:
                self._take_down(path, reason, directory)
                return False
        return True

    def _take_down(self, path: _Path, reason: str, directory: CacheDir | None = None) -> None:
        """Out of service, unless ``directory`` (what the failing request used) is no longer
        the path's. Its files stay open (a request may still be using them) until the path
        is tried again, ``retry_every`` seconds on, or the tier closes."""
        with self._down_lock:
            if (path.dir is None and path.down_reason) or (
                    directory is not None and path.dir is not directory):
                return
            path.down_reason = f"{path.root}: {reason}"
            if path.dir is not None:
                path.stale, path.dir = path.dir, None
            if path.retry_every is not None:
                now = time.monotonic()
                if (path.back_at and path.retry_first is not None
                        and now - path.back_at >= path.retry_every):
                    path.retry_every = path.retry_first  # it held longer than its last wait
                path.retry_at = now + path.retry_every
        log.error("kvtier disk path out of service: %s (%s)", path.down_reason,
                  "not tried again: disk_retry is off" if path.retry_every is None
                  else f"tried again in {path.retry_every:g} s")

    def revive_due(self) -> list[int]:
        """Indexes of paths out of service whose next try is due (no I/O: cheap to call)."""
        now = time.monotonic()
        return [i for i, p in enumerate(self._paths)
                if p.dir is None and p.retry_every is not None and now >= p.retry_at]

    def revive(self, index: int) -> bool:
        """Try to bring path ``index`` back (blocking: run it on the path's queue).

        The path is opened as at start, with every check (ownership, permissions, lock,
        O_DIRECT); True when it is back in service, its slots empty to the bookkeeping.
        Each try doubles the wait before the next one, up to ten minutes (or ``retry``): a
        path that keeps failing is tried less and less. One that comes back and then stays in
        service for at least its current wait starts again from ``retry`` when it next fails.
        """
        path = self._paths[index]
        with self._down_lock:
            if path.dir is not None or path.retry_every is None:
                return False
            path.retry_every = max(path.retry_every, min(2 * path.retry_every, _RETRY_MAX_S))
            path.retry_at = time.monotonic() + path.retry_every
            stale, path.stale = path.stale, None
        if stale is not None:
            stale.close()
        try:
            directory, inode = self._open(path)
        except OSError as exc:
            log.debug("kvtier disk path %s still out of service: %s", path.root, exc)
            return False
        with self._down_lock:
            was, path.down_reason = path.down_reason, ""
            path.eio_run, path.inode, path.checked_at = 0, inode, time.monotonic()
            path.dir, path.back_at = directory, path.checked_at
        log.warning("kvtier disk path back in service: %s (was out: %s)", path.root, was)
        return True

    def close(self) -> None:
        for path in self._paths:
            for directory in (path.dir, path.stale):
                if directory is not None:
                    directory.close()
