"""The disk tier against fio and the naive baseline, in one run, on one directory.

For each chunk size and queue depth: N bytes of chunks written from host slots to the disk
tier (a second, timed pass overwrites the first, as in steady state) and read back into
host slots with every checksum verified; then fio (libaio, same I/O size and depth) and one
buffered file per chunk (one at a time) on the same directory.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvtier.bench.aio import aiofiles_read_gib_s, have_aiofiles
from kvtier.bench.fio import fio_bandwidth, have_fio
from kvtier.bench.naive import drop_cache, naive_round_trip
from kvtier.bench.passes import TierUnderTest, time_reads, time_writes
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
    stride = 4096 + host.slot_bytes
    directories = directory if isinstance(directory, list) else [directory]
    works = [Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=d)) for d in directories]
    count -= count % len(works)
    tier = TierUnderTest(works, chunk_bytes, host, count, depth, batch,
                         o_direct=o_direct, compression=compression)
    write_latency: list[float] = []
    read_latency: list[float] = []
    try:
        tier.run(tier.write)  # the first pass allocates; the timed ones overwrite
        files = sorted(f for w in works for f in w.glob("*/slots-*.kvt"))
        writes = time_writes(tier, files, o_direct, write_latency, repeats, min_seconds)
        stored = tier.stored // (len(writes) + 1)
        reads = time_reads(tier, files, read_latency, repeats, min_seconds)
        aio = None
        if with_aiofiles and len(works) == 1 and have_aiofiles():
            drop_cache(files)
            aio = aiofiles_read_gib_s(files[0], stride, count, depth, o_direct) * chunk_bytes / stride
    finally:
        tier.close()
        for work in works:
            shutil.rmtree(work)
    gib = count * chunk_bytes / 2**30
    ratio = count * (4096 + chunk_bytes) / max(stored, 1)
    return DiskFigures(gib / min(writes), gib / min(reads[True]), gib / min(reads[False]), ratio, aio,
                       tuple(write_latency), tuple(read_latency))


@dataclass(frozen=True)
class _Sweep:
    """The cases ``bench_directory`` runs on one directory, for each chunk size."""
    label: str
    directory: Path
    depths: list[int]
    total: int
    batches: Sequence[int]
    o_direct_modes: Sequence[bool]
    compression_size: int
    baselines: bool
    progress: Callable[[str], None]


def bench_directory(label: str, directory: Path, chunk_sizes: list[int], depths: list[int],
                    total: int, *, batches: Sequence[int] = (1,),
                    o_direct_modes: Sequence[bool] = (True, False), compression_size: int = 0,
                    baselines: bool = True, progress: Callable[[str], None] = print) -> list[DiskResult]:
    """Every case on one directory; fio and the naive baseline once per chunk size/depth."""
    sweep = _Sweep(label, directory, depths, total, batches, o_direct_modes, compression_size,
                   baselines, progress)
    results = []
    for chunk_bytes in chunk_sizes:
        results += _bench_chunk_size(sweep, chunk_bytes)
    return results


def _bench_chunk_size(sweep: _Sweep, chunk_bytes: int) -> list[DiskResult]:
    """Every case of one chunk size, from host slots of KV-like bytes; the naive baseline once."""
    count = sweep.total // chunk_bytes
    host = HostTier(count, -(-chunk_bytes // 4096) * 4096)
    host.buffer.array[:] = kv_like_bytes(host.buffer.size)
    naive: tuple[float | None, float | None] = (None, None)
    if sweep.baselines:
        naive = naive_round_trip(sweep.directory / f"naive-{chunk_bytes}",
                                 [host.slot_array(i)[:chunk_bytes] for i in range(count)])
    results = []
    for depth in sweep.depths:
        results += _bench_depth(sweep, host, chunk_bytes, depth, naive)
    if sweep.compression_size:
        results.append(_bench_compression(sweep, host, chunk_bytes))
    host.close()
    return results


def _bench_depth(sweep: _Sweep, host: HostTier, chunk_bytes: int, depth: int,
                 naive: tuple[float | None, float | None]) -> list[DiskResult]:
    """One chunk size at one queue depth: fio once, then each O_DIRECT batch size, then
    buffered I/O (at the deepest queue only)."""
    count = sweep.total // chunk_bytes
    fio: tuple[float | None, float | None] = (None, None)
    if sweep.baselines and have_fio():
        block, size = 4096 + host.slot_bytes, count * chunk_bytes
        fio = (fio_bandwidth(sweep.directory, "write", block, size, depth),
               fio_bandwidth(sweep.directory, "read", block, size, depth))
    results = []
    for o_direct in sweep.o_direct_modes:
        if not o_direct and depth != max(sweep.depths):
            continue  # buffered I/O: one depth is enough to show the difference
        for batch in sweep.batches if o_direct else (1,):
            sweep.progress(f"{sweep.label}: {chunk_bytes >> 20} MiB chunks, depth {depth}, batch "
                           f"{batch}, {'O_DIRECT' if o_direct else 'buffered'}")
            figures = measure_disk_tier(sweep.directory, chunk_bytes, sweep.total, depth,
                                        o_direct=o_direct, compression=False, host=host,
                                        with_aiofiles=sweep.baselines, batch=batch)
            results.append(DiskResult(
                sweep.label, chunk_bytes, depth, batch, o_direct, False, count * chunk_bytes,
                figures.write_gib_s, figures.read_gib_s, figures.read_unverified_gib_s,
                figures.stored_ratio, figures.aiofiles_read_gib_s, *fio, *naive))
    return results


def _bench_compression(sweep: _Sweep, host: HostTier, chunk_bytes: int) -> DiskResult:
    """zstd, O_DIRECT, at the deepest queue, on ``compression_size`` bytes of whole chunks."""
    depth = max(sweep.depths)
    sweep.progress(f"{sweep.label}: {chunk_bytes >> 20} MiB chunks, depth {depth}, zstd")
    small = sweep.compression_size // chunk_bytes * chunk_bytes
    figures = measure_disk_tier(sweep.directory, chunk_bytes, small, depth,
                                o_direct=True, compression=True, host=host)
    return DiskResult(sweep.label, chunk_bytes, depth, 1, True, True, small,
                      figures.write_gib_s, figures.read_gib_s,
                      figures.read_unverified_gib_s, figures.stored_ratio)


def checksum_gib_s(size: int = 256 * 2**20) -> float:
    """XXH3-64 speed on one core over ``size`` bytes (verification cost per byte read)."""
    raw = kv_like_bytes(size)
    start = time.perf_counter()
    for _ in range(4):
        xxhash.xxh3_64_intdigest(raw.data)
    return 4 * size / 2**30 / (time.perf_counter() - start)
