"""The disk tier against fio and the naive baseline, in one run, on one directory.

For each chunk size and queue depth: N bytes of chunks written from host slots to the disk
tier (a second, timed pass overwrites the first, as in steady state) and read back into
host slots with every checksum verified; then fio (libaio, same I/O size and depth) and one
buffered file per chunk (one at a time) on the same directory.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvtier.bench.aio import aiofiles_read_gib_s
from kvtier.bench.fio import fio_bandwidth, have_fio
from kvtier.bench.naive import drop_cache, naive_round_trip
from kvtier.config import DiskFloor
from kvtier.io.engine import IOEngine
from kvtier.keys import ChunkKey, Namespace
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier


@dataclass(frozen=True)
class DiskResult:
    label: str
    chunk_bytes: int
    depth: int
    batch: int
    o_direct: bool
    compression: bool
    bytes: int
    write_gib_s: float
    read_gib_s: float  # every payload checksum verified
    read_unverified_gib_s: float  # the same reads without payload checksums
    stored_ratio: float  # raw bytes / bytes on disk
    aiofiles_read_gib_s: float | None = None  # the same slot reads through aiofiles
    fio_write_gib_s: float | None = None
    fio_read_gib_s: float | None = None
    naive_write_gib_s: float | None = None
    naive_read_gib_s: float | None = None

    def as_dict(self) -> dict:
        out = asdict(self)
        out["verify_cost"] = 1 - self.read_gib_s / self.read_unverified_gib_s
        if self.fio_read_gib_s:
            assert self.fio_write_gib_s is not None, "fio figures come in pairs"
            out["read_vs_fio"] = self.read_gib_s / self.fio_read_gib_s
            out["write_vs_fio"] = self.write_gib_s / self.fio_write_gib_s
        if self.aiofiles_read_gib_s:
            out["aiofiles_vs_kvtier"] = self.aiofiles_read_gib_s / self.read_gib_s
        if self.naive_read_gib_s:
            assert self.naive_write_gib_s is not None, "naive figures come in pairs"
            out["read_vs_naive"] = self.read_gib_s / self.naive_read_gib_s
            out["write_vs_naive"] = self.write_gib_s / self.naive_write_gib_s
        return out


def kv_like_bytes(size: int) -> np.ndarray:
    """bf16 values of a normal distribution, like real KV (64 MiB pattern, repeated)."""
    pattern = torch.randn(min(size, 64 * 2**20) // 2, generator=torch.Generator().manual_seed(0))
    raw = pattern.bfloat16().view(torch.uint8).numpy()
    return np.resize(raw, size)


def _run_all(engine: IOEngine, count: int, batch: int, op: Callable[[range], list],
             latencies: list[float] | None = None,
             queue_of: Callable[[int], str] = lambda slot: "disk0") -> float:
    """Seconds to run ``op`` over ``range(count)`` in batches of ``batch`` neighbours;
    each batch's service time (from the start of its I/O to its end) goes to ``latencies``."""
    latencies = [] if latencies is None else latencies

    def job(b: int) -> list:
        started = time.perf_counter()
        results = op(range(b, min(b + batch, count)))
        latencies.append(time.perf_counter() - started)
        return results

    start = time.perf_counter()
    futures = [engine.submit(queue_of(b), functools.partial(job, b)) for b in range(0, count, batch)]
    results = [r for f in futures for r in f.result()]
    elapsed = time.perf_counter() - start
    bad = [r for r in results if not r.ok]
    if bad:  # no space, a failing device, a path gone: an outcome to report, not a bug
        raise OSError(f"{len(bad)} of {len(results)} disk requests failed, first: "
                      f"{bad[0].status.value}: {bad[0].detail}")
    return elapsed


@dataclass(frozen=True)
class DiskFigures:
    write_gib_s: float
    read_gib_s: float
    read_unverified_gib_s: float
    stored_ratio: float
    aiofiles_read_gib_s: float | None
    write_latency_s: tuple[float, ...]  # per batch, start of its I/O to its end, last pass
    read_latency_s: tuple[float, ...]


def measure_disk_tier(directory: Path | list[Path], chunk_bytes: int, total: int, depth: int, *,
                      o_direct: bool, compression: bool, host: HostTier,
                      with_aiofiles: bool = False, repeats: int = 3, batch: int = 1,
                      min_seconds: float = 0.0) -> DiskFigures:
    """Store and load ``total`` bytes of chunks through a disk tier in ``directory`` (or
    striped over several directories, ``depth`` threads each): at least ``repeats`` timed
    passes each way, more until writes and verified reads have each taken ``min_seconds``/2;
    the best pass counts."""
    count = min(total // chunk_bytes, host.num_slots)
    namespace = Namespace(model="bench", kv_dtype="bfloat16", layout=f"bench:{chunk_bytes}",
                          block_tokens=1, chunk_tokens=1)
    stride = 4096 + host.slot_bytes
    directories = directory if isinstance(directory, list) else [directory]
    works = [Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=d)) for d in directories]
    count -= count % len(works)
    disk = DiskTier([str(w) for w in works], namespace, chunk_bytes, count * stride,
                    compression=compression,
                    o_direct=o_direct, floor=DiskFloor())
    engine = IOEngine(disk.queues, depth)
    keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(count)]
    stored = [0]

    def write(batch_slots: range):
        results = disk.write_many([(i, keys[i], host.slot_array(i)) for i in batch_slots])
        stored[0] += sum(r.nbytes for r in results)
        return results

    def read(batch_slots: range):
        return disk.read_many([(i, keys[i], host.slot_array(i)) for i in batch_slots])

    try:
        run = functools.partial(_run_all, engine, count, batch, queue_of=disk.queue_of)
        run(write)  # the first pass allocates; the timed ones overwrite
        files = sorted(f for w in works for f in w.glob("*/slots-*.kvt"))
        write_latency: list[float] = []
        writes: list[float] = []
        while len(writes) < repeats or sum(writes) < min_seconds / 2:
            write_latency.clear()
            writes.append(_timed_write(run, write, files, o_direct, write_latency))
        write_s = min(writes)
        stored[0] //= len(writes) + 1
        reads: dict[bool, list[float]] = {True: [], False: []}
        read_latency: list[float] = []
        while len(reads[True]) < repeats or sum(reads[True]) < min_seconds / 2:
            for verify in (True, False):  # verified and unverified interleaved, best of each
                disk.verify_payload = verify
                drop_cache(files)
                if verify:
                    read_latency.clear()
                reads[verify].append(run(read, read_latency if verify else None))
        aio = None
        if with_aiofiles and len(works) == 1:
            drop_cache(files)
            aio = aiofiles_read_gib_s(files[0], stride, count, depth, o_direct) * chunk_bytes / stride
    finally:
        engine.close()
        disk.close()
        for work in works:
            shutil.rmtree(work)
    gib = count * chunk_bytes / 2**30
    ratio = count * (4096 + chunk_bytes) / max(stored[0], 1)
    return DiskFigures(gib / write_s, gib / min(reads[True]), gib / min(reads[False]), ratio, aio,
                       tuple(write_latency), tuple(read_latency))


def _timed_write(run, write, files: list[Path], o_direct: bool,
                 latencies: list[float] | None = None) -> float:
    elapsed = run(write, latencies)
    if not o_direct:
        start = time.perf_counter()
        drop_cache(files)  # buffered writes count once they reach the device
        elapsed += time.perf_counter() - start
    return elapsed


def bench_directory(label: str, directory: Path, chunk_sizes: list[int], depths: list[int],
                    total: int, *, batches=(1,), o_direct_modes=(True, False), compression_size: int = 0,
                    baselines: bool = True, progress: Callable[[str], None] = print) -> list[DiskResult]:
    """Every case on one directory; fio and the naive baseline once per chunk size/depth."""
    results = []
    for chunk_bytes in chunk_sizes:
        count = total // chunk_bytes
        host = HostTier(count, -(-chunk_bytes // 4096) * 4096)
        host.buffer.array[:] = kv_like_bytes(host.buffer.size)
        naive: tuple[float | None, float | None] = (None, None)
        if baselines:
            naive = naive_round_trip(directory / f"naive-{chunk_bytes}",
                                     [host.slot_array(i)[:chunk_bytes] for i in range(count)])
        for depth in depths:
            fio: tuple[float | None, float | None] = (None, None)
            if baselines and have_fio():
                block, size = 4096 + host.slot_bytes, count * chunk_bytes
                fio = (fio_bandwidth(directory, "write", block, size, depth),
                       fio_bandwidth(directory, "read", block, size, depth))
            for o_direct in o_direct_modes:
                if not o_direct and depth != max(depths):
                    continue  # buffered I/O: one depth is enough to show the difference
                for batch in batches if o_direct else (1,):
                    progress(f"{label}: {chunk_bytes >> 20} MiB chunks, depth {depth}, batch "
                             f"{batch}, {'O_DIRECT' if o_direct else 'buffered'}")
                    figures = measure_disk_tier(directory, chunk_bytes, total, depth,
                                                o_direct=o_direct, compression=False, host=host,
                                                with_aiofiles=baselines, batch=batch)
                    results.append(DiskResult(
                        label, chunk_bytes, depth, batch, o_direct, False, count * chunk_bytes,
                        figures.write_gib_s, figures.read_gib_s, figures.read_unverified_gib_s,
                        figures.stored_ratio, figures.aiofiles_read_gib_s, *fio, *naive))
        if compression_size:
            depth = max(depths)
            progress(f"{label}: {chunk_bytes >> 20} MiB chunks, depth {depth}, zstd")
            small = compression_size // chunk_bytes * chunk_bytes
            figures = measure_disk_tier(directory, chunk_bytes, small, depth,
                                        o_direct=True, compression=True, host=host)
            results.append(DiskResult(label, chunk_bytes, depth, 1, True, True, small,
                                      figures.write_gib_s, figures.read_gib_s,
                                      figures.read_unverified_gib_s, figures.stored_ratio))
        host.close()
    return results


def checksum_gib_s(size: int = 256 * 2**20) -> float:
    """XXH3-64 speed on one core over ``size`` bytes (verification cost per byte read)."""
    raw = kv_like_bytes(size)
    start = time.perf_counter()
    for _ in range(4):
        xxhash.xxh3_64_intdigest(raw.data)
    return 4 * size / 2**30 / (time.perf_counter() - start)
