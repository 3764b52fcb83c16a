"""Timed passes of host slots through a scratch disk tier: what ``measure_disk_tier`` times.

A pass writes (or reads) every slot once, in batches of neighbouring slots submitted to the
tier's I/O engine; its time runs from the first submit to the last result.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.bench.naive import drop_cache
from kvtier.config.settings import DiskFloor
from kvtier.disk.tier import DiskTier
from kvtier.io.engine import IOEngine
from kvtier.io.result import IOResult
from kvtier.keys import ChunkKey, Namespace
from kvtier.tiers.host import HostTier


def run_all(engine: IOEngine, count: int, batch: int, op: Callable[[range], list],
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


class TierUnderTest:
    """A disk tier striped over the scratch directories ``works``, with an I/O engine of
    ``depth`` threads per queue and one key per host slot ``0..count-1``."""

    def __init__(self, works: list[Path], chunk_bytes: int, host: HostTier, count: int, depth: int,
                 batch: int, *, o_direct: bool, compression: bool) -> None:
        namespace = Namespace(model="bench", kv_dtype="bfloat16", layout=f"bench:{chunk_bytes}",
                              block_tokens=1, chunk_tokens=1)
        self.disk = DiskTier([str(w) for w in works], namespace, chunk_bytes,
                             count * (4096 + host.slot_bytes), compression=compression,
                             o_direct=o_direct, floor=DiskFloor())
        self.engine = IOEngine(self.disk.queues, depth)
        self.host, self.count, self.batch = host, count, batch
        self.keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(count)]
        self.stored = 0  # bytes on disk, summed over every write pass

    def run(self, op: Callable[[range], list], latencies: list[float] | None = None) -> float:
        """Seconds of one pass of ``op`` (``write`` or ``read``) over every slot."""
        return run_all(self.engine, self.count, self.batch, op, latencies,
                       queue_of=self.disk.queue_of)

    def write(self, slots: range) -> list[IOResult]:
        results = self.disk.write_many([(i, self.keys[i], self.host.slot_array(i)) for i in slots])
        self.stored += sum(r.nbytes for r in results)
        return results

    def read(self, slots: range) -> list[IOResult]:
        return self.disk.read_many([(i, self.keys[i], self.host.slot_array(i)) for i in slots])

    def close(self) -> None:
        self.engine.close()
        self.disk.close()


def time_writes(tier: TierUnderTest, files: list[Path], o_direct: bool, latencies: list[float],
                repeats: int, min_seconds: float) -> list[float]:
    """Seconds of each timed write pass: at least ``repeats``, more until they add up to
    ``min_seconds``/2; ``latencies`` ends with the last pass's."""
    writes: list[float] = []
    while len(writes) < repeats or sum(writes) < min_seconds / 2:
        latencies.clear()
        writes.append(timed_write(tier, files, o_direct, latencies))
    return writes


def timed_write(tier: TierUnderTest, files: list[Path], o_direct: bool,
                latencies: list[float] | None = None) -> float:
    elapsed = tier.run(tier.write, latencies)
    if not o_direct:
        start = time.perf_counter()
        drop_cache(files)  # buffered writes count once they reach the device
        elapsed += time.perf_counter() - start
    return elapsed


def time_reads(tier: TierUnderTest, files: list[Path], latencies: list[float], repeats: int,
               min_seconds: float) -> dict[bool, list[float]]:
    """Seconds of each read pass from a cold page cache, by whether payloads were verified:
    verified and unverified passes interleaved, until the verified ones number ``repeats``
    and add up to ``min_seconds``/2; ``latencies`` ends with the last verified pass's."""
    reads: dict[bool, list[float]] = {True: [], False: []}
    while len(reads[True]) < repeats or sum(reads[True]) < min_seconds / 2:
        for verify in (True, False):  # verified and unverified interleaved, best of each
            tier.disk.verify_payload = verify
            drop_cache(files)
            if verify:
                latencies.clear()
            reads[verify].append(tier.run(tier.read, latencies if verify else None))
    return reads
