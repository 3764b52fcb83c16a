"""The floor for any Python reader of chunks: a ``get``'s reads and checksums, nothing else.

One file of chunks laid out as kvtier's slots are (a 4 KiB header block, then the payload),
read back O_DIRECT by a few threads, runs of neighbouring chunks one ``preadv`` each, every
payload scattered over its rows of a prefix buffer (a KV tensor's layers, K and V, as a
``get`` into ``empty_kv`` scatters it) and, checked, hashed with XXH3 as kvtier checks it.
No index, no pinning, no futures, no header checks, and reads streamed across prefixes (a
``get`` waits for its prefix's last read): what is left between this and fio is the cost
of doing the I/O and the hashing from Python on this machine; what is left between a
``KVStore.get`` and this is kvtier's, and the get's wait at each prefix's end.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import xxhash

from kvtier.bench.naive import drop_page_cache

HEADER = 4096  # a slot's header block


class BareRead(NamedTuple):
    gib_s: float  # GiB/s read
    cpu_per_gib: float  # seconds of this process's CPU (user and system) per GiB read


def bare_read_bandwidth(directory: Path, chunk_bytes: int, total: int, rows: int,
                        prefix_bytes: int, threads: int = 4, run: int = 8,
                        verify: bool = True) -> BareRead:
    """GiB/s (and CPU per GiB) of reading ``total`` bytes of ``chunk_bytes`` chunks (page
    cache dropped) into a reused buffer of ``prefix_bytes``, each chunk's payload over
    ``rows`` rows (``rows`` divides ``chunk_bytes``, each row a whole number of pages), ``run``
    chunks a call on each of ``threads`` threads; with ``verify``, each payload hashed."""
    row = chunk_bytes // rows
    if row * rows != chunk_bytes or row % mmap.PAGESIZE or prefix_bytes % chunk_bytes:
        raise ValueError(f"{rows} rows of a {chunk_bytes}-byte chunk in a {prefix_bytes}-byte "
                         "prefix: each row must be whole pages and the prefix whole chunks")
    stride, count = HEADER + chunk_bytes, max(1, total // chunk_bytes)
    path = directory / "kvtier-bare-reads.dat"
    path.unlink(missing_ok=True)  # a run killed before its clean-up (a link: the link)
    try:
        _lay_out(path, stride, count)
        drop_page_cache()
        out = mmap.mmap(-1, prefix_bytes)
        out.write(b"\1" * prefix_bytes)  # faulted in, as a reused tensor is
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW)
        try:
            reads = _Reads(fd, path, memoryview(out), chunk_bytes, rows, count, run, verify)
            seconds, cpu = _timed(reads.reader, threads)
        finally:
            os.close(fd)
        if reads.errors:
            raise reads.errors[0]
        gib = count * chunk_bytes / 2**30
        return BareRead(gib / seconds, cpu / gib)
    finally:
        path.unlink(missing_ok=True)


def _timed(reader: Callable[[], None], threads: int) -> tuple[float, float]:
    """Seconds, and seconds of this process's CPU, that ``threads`` threads of ``reader`` take."""
    start, cpu = time.perf_counter(), time.process_time()
    workers = [threading.Thread(target=reader) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - start, time.process_time() - cpu


class _Reads:
    """The reads of the ``count`` chunks of the file open at ``fd``, ``run`` neighbours a
    ``preadv``, claimed in turn by the reader threads; each chunk's payload over its ``rows``
    rows of ``view`` (the prefix buffer). ``errors``: what failed a reader."""

    def __init__(self, fd: int, path: Path, view: memoryview, chunk_bytes: int, rows: int,
                 count: int, run: int, verify: bool) -> None:
        self.fd, self.path, self.view, self.count, self.run = fd, path, view, count, run
        self.rows, self.verify, self.stride = rows, verify, HEADER + chunk_bytes
        self.row, self.plane = chunk_bytes // rows, len(view) // rows
        self.per_prefix = len(view) // chunk_bytes
        self.claimed, self.lock = 0, threading.Lock()
        self.errors: list[BaseException] = []

    def reader(self) -> None:
        try:
            self._read_runs()
        except BaseException as exc:  # the run's figure would be wrong: raised by the caller
            self.errors.append(exc)

    def _claim(self) -> int:
        """The first chunk of the next run to read."""
        with self.lock:
            first = self.claimed
            self.claimed += self.run
        return first

    def _read_runs(self) -> None:
        headers = memoryview(mmap.mmap(-1, HEADER * self.run))
        view, rows, row, plane, stride = self.view, self.rows, self.row, self.plane, self.stride
        while (first := self._claim()) < self.count:
            pieces = []
            for j in range(min(self.run, self.count - first)):
                at = (first + j) % self.per_prefix * row
                pieces.append([view[r * plane + at:r * plane + at + row] for r in range(rows)])
            iov = [b for j, p in enumerate(pieces) for b in (headers[j * HEADER:(j + 1) * HEADER], *p)]
            if os.preadv(self.fd, iov, first * stride) != len(pieces) * stride:
                raise OSError(f"{self.path}: short read at chunk {first}")
            for p in pieces if self.verify else ():
                digest = xxhash.xxh3_64()
                for piece in p:
                    digest.update(piece)
                digest.intdigest()


def _lay_out(path: Path, stride: int, count: int) -> None:
    """Write ``count`` slots of ``stride`` bytes (O_DIRECT: on the device, not in cache)."""
    group = max(1, (8 << 20) // stride)
    buffer = mmap.mmap(-1, group * stride)
    buffer.write(os.urandom(256) * (group * stride // 256))
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT | os.O_NOFOLLOW, 0o600)
    try:
        for first in range(0, count, group):
            n = min(group, count - first)
            os.pwritev(fd, [memoryview(buffer)[:n * stride]], first * stride)
    finally:
        os.close(fd)
