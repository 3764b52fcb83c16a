"""``kvtier bench``: how fast this machine moves KV through the host and disk tiers, and what
that means for time to first token against recomputing the prefix."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvtier.bench.disk import kv_like_bytes, measure_disk_tier
from kvtier.bench.fio import fio_bandwidth, have_fio
from kvtier.bench.naive import naive_round_trip
from kvtier.io.buffers import align_up
from kvtier.layout import KVLayout
from kvtier.store.kvstore import KVStore
from kvtier.tiers.host import HostTier
from kvtier.units import format_size

PRESETS = {  # per-GPU-shard KV shapes of common models (no tensor parallelism)
    "llama-3-8b": KVLayout(num_layers=32, kv_heads=8, head_size=128, dtype="bfloat16"),
    "qwen2.5-32b": KVLayout(num_layers=64, kv_heads=8, head_size=128, dtype="bfloat16"),
    "llama-3-70b": KVLayout(num_layers=80, kv_heads=8, head_size=128, dtype="bfloat16"),
}
# Rough prefill speeds of one H100 in tokens/s, used only when --prefill-tps is not given,
# and reported as assumed.
ASSUMED_PREFILL_TPS = {"llama-3-8b": 12_000, "qwen2.5-32b": 3_000, "llama-3-70b": 1_500}
MAX_DEPTH = 256  # I/O threads per disk path
MIN_CHUNK_BYTES = 4096  # one page: the disk tier's unit of O_DIRECT I/O


@dataclass
class BenchSpec:
    layout: KVLayout
    name: str = "custom"
    chunk_tokens: int = 256
    size: int = 1 << 30
    depths: list[int] = field(default_factory=lambda: [1, 4, 16])
    disk: bool = True
    disk_paths: list[Path] = field(default_factory=list)  # default: a temporary directory
    compression: bool = False
    baselines: bool = True
    prompt_tokens: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 65536])
    prefill_tps: float | None = None
    seconds_per_depth: float = 0.0  # keep measuring each depth at least this long

    def __post_init__(self) -> None:
        """Refuse, with ``ValueError`` naming the ``kvtier bench`` option, what cannot run.
        A size under one chunk per disk path is rounded up to that."""
        _check_counts(self)
        _check_chunk(self)
        self.size = max(self.size, self.chunk_bytes * max(1, len(self.disk_paths)))
        _check_memory(self)

    @property
    def chunk_bytes(self) -> int:
        return self.layout.token_bytes * self.chunk_tokens


def _check_counts(spec: BenchSpec) -> None:
    bad = [d for d in spec.depths if not 1 <= d <= MAX_DEPTH]
    if not spec.depths or bad:
        raise ValueError(f"--depths must each be from 1 to {MAX_DEPTH}, got {bad or 'none'}")
    bad = [t for t in spec.prompt_tokens if t < 1]
    if not spec.prompt_tokens or bad:
        raise ValueError(f"--prompt-tokens must each be at least 1, got {bad or 'none'}")
    tps = spec.prefill_tps
    if tps is not None and not (math.isfinite(tps) and tps > 0):
        raise ValueError(f"--prefill-tps must be a positive number of tokens/s, got {tps:g}")
    if not (math.isfinite(spec.seconds_per_depth) and spec.seconds_per_depth >= 0):
        raise ValueError(f"--duration must not be negative, got {spec.seconds_per_depth:g} s")


def _check_chunk(spec: BenchSpec) -> None:
    if spec.chunk_tokens < 1:
        raise ValueError(f"--chunk-tokens must be at least 1, got {spec.chunk_tokens}")
    if spec.chunk_bytes < MIN_CHUNK_BYTES:
        raise ValueError(f"--chunk-tokens {spec.chunk_tokens} makes {spec.chunk_bytes}-byte chunks "
                         f"of this model's KV; the smallest chunk is {MIN_CHUNK_BYTES} bytes")
    if spec.size < 1:
        raise ValueError(f"--size must be at least 1 byte, got {spec.size}")


def _check_memory(spec: BenchSpec) -> None:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if spec.size > memory // 2:
        raise ValueError(f"a pass of {format_size(spec.size)} (--size, at least one chunk per "
                         f"disk path) is more than half of this machine's memory "
                         f"({format_size(memory)}); the host tier holds it all")


def _percentiles(seconds) -> dict[str, float]:
    values = np.asarray(seconds, dtype=float) * 1000
    if values.size == 0:
        return {}
    return {"p50_ms": float(np.percentile(values, 50)), "p99_ms": float(np.percentile(values, 99))}


def bench_host(spec: BenchSpec, advance: Callable[[int], None]) -> dict:
    """Put and get ``spec.size`` bytes, one chunk per call, through a host-only KVStore."""
    layout, chunk = spec.layout, spec.chunk_tokens
    count = max(1, spec.size // spec.chunk_bytes)
    kv = torch.empty(layout.shape(chunk), dtype=getattr(torch, layout.dtype))
    kv.view(torch.uint8).view(-1).copy_(torch.from_numpy(kv_like_bytes(kv.numel() * kv.element_size())))
    out = torch.empty_like(kv)
    config = {"chunk_tokens": chunk, "host_capacity": (count + 1) * align_up(spec.chunk_bytes)}
    put_s, get_s = [], []
    with KVStore(layout, config, model=f"kvtier-bench/{spec.name}") as store:
        for i in range(count):
            tokens = np.arange(chunk) + i * chunk
            start = time.perf_counter()
            store.put(tokens, kv)
            put_s.append(time.perf_counter() - start)
            advance(1)
        for i in range(count):
            start = time.perf_counter()
            assert store.get(np.arange(chunk) + i * chunk, out) == chunk
            get_s.append(time.perf_counter() - start)
            advance(1)
    gib = count * layout.token_bytes * chunk / 2**30
    return {"chunks": count, "store_gib_s": gib / sum(put_s), "load_gib_s": gib / sum(get_s),
            "store_latency": _percentiles(put_s), "load_latency": _percentiles(get_s)}


def bench_disk(spec: BenchSpec, advance: Callable[[int], None]) -> dict:
    """The disk tier at each queue depth, with fio and the naive baseline beside it."""
    chunk_bytes = spec.chunk_bytes
    count = max(1, spec.size // chunk_bytes)
    host = HostTier(count, align_up(chunk_bytes))
    host.buffer.array[:] = kv_like_bytes(host.buffer.size)
    rows = []
    try:
        for depth in spec.depths:
            figures = measure_disk_tier(spec.disk_paths, chunk_bytes, count * chunk_bytes, depth,
                                        o_direct=True, compression=spec.compression, host=host,
                                        repeats=2, min_seconds=spec.seconds_per_depth)
            row = {"depth": depth, "store_gib_s": figures.write_gib_s,
                   "load_gib_s": figures.read_gib_s, "stored_ratio": figures.stored_ratio,
                   "store_latency": _percentiles(figures.write_latency_s),
                   "load_latency": _percentiles(figures.read_latency_s)}
            if spec.baselines and have_fio():  # paths are independent: their ceilings add up
                block, share = 4096 + host.slot_bytes, count * chunk_bytes // len(spec.disk_paths)
                fio_write = sum(fio_bandwidth(p, "write", block, share, depth) for p in spec.disk_paths)
                fio_read = sum(fio_bandwidth(p, "read", block, share, depth) for p in spec.disk_paths)
                row["fio_write_gib_s"], row["fio_read_gib_s"] = fio_write, fio_read
                row["store_vs_fio"] = figures.write_gib_s / fio_write
                row["load_vs_fio"] = figures.read_gib_s / fio_read
            rows.append(row)
            advance(1)
        naive = None
        if spec.baselines:
            # a directory of its own: a "naive" entry of the user's is never touched
            where = Path(tempfile.mkdtemp(prefix="kvtier-naive-", dir=spec.disk_paths[0]))
            write, read = naive_round_trip(where, [host.slot_array(i)[:chunk_bytes]
                                                   for i in range(count)], passes=2)
            naive = {"store_gib_s": write, "load_gib_s": read}
            shutil.rmtree(where, ignore_errors=True)
        advance(1)
    finally:
        host.close()
    return {"chunks": count, "chunk_bytes": chunk_bytes, "depths": rows, "naive": naive,
            "fio": have_fio()}


def ttft_estimate(spec: BenchSpec, host: dict, disk: dict | None) -> dict:
    """Seconds to load N tokens' KV from host and from disk, against recomputing them."""
    tps = spec.prefill_tps
    if tps is None:
        tps = ASSUMED_PREFILL_TPS.get(spec.name, 5_000)
    best_disk = max((r["load_gib_s"] for r in disk["depths"]), default=None) if disk else None
    rows = []
    for tokens in spec.prompt_tokens:
        gib = tokens * spec.layout.token_bytes / 2**30
        row = {"tokens": tokens, "recompute_s": tokens / tps, "host_s": gib / host["load_gib_s"]}
        if best_disk:
            row["disk_s"] = gib / best_disk + row["host_s"]
        rows.append(row)
    return {"prefill_tps": tps, "prefill_assumed": spec.prefill_tps is None, "rows": rows}


def run(spec: BenchSpec, progress: Callable[[str, int], Callable[[int], None]]) -> dict:
    """Everything ``kvtier bench`` measures; ``progress(label, total)`` gives an advance()."""
    owned = spec.disk and not spec.disk_paths
    if owned:
        spec.disk_paths = [Path(tempfile.mkdtemp(prefix="kvtier-bench-"))]
    try:
        count = max(1, spec.size // spec.chunk_bytes)
        host = bench_host(spec, progress("host tier", 2 * count))
        disk = bench_disk(spec, progress("disk tier", len(spec.depths) + 1)) if spec.disk else None
    finally:
        if owned:
            shutil.rmtree(spec.disk_paths[0], ignore_errors=True)
    layout = asdict(spec.layout)
    return {"preset": spec.name, "layout": layout, "chunk_tokens": spec.chunk_tokens,
            "disk_paths": [str(p) for p in spec.disk_paths] if not owned else ["(temporary)"],
            "chunk_bytes": spec.chunk_bytes, "size": spec.size,
            "host": host, "disk": disk, "ttft": ttft_estimate(spec, host, disk)}
