"""What the disk tier's writes could reach at most on a device: bare slot writes, in one run.

    python scripts/bench_write_ceiling.py --dir /mnt/kvtier-ram --chunks 2MiB,32MiB --depth 16

For each chunk size, the same N bytes of slots (4 KiB header + payload, O_DIRECT, from one
huge-page host buffer like the host tier's, overwriting a preallocated file) are written by
``depth`` threads three ways, passes interleaved, best of 5 each:

- ``bare``: one ``os.pwritev`` per slot and nothing else: the ceiling of any Python writer;
- ``checksummed``: the same after XXH3-64 of the payload, as every slot header needs;
- ``disk tier``: ``DiskTier.write_many`` (header, checksum, bookkeeping, index entry; its
  slots spread over the tier's files, the other two write one file).

The ratio ``disk tier / checksummed`` is the cost of kvtier's own bookkeeping; ``checksummed /
bare`` the cost of checking every byte on a machine whose cores also do the device's copies.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from kvtier.bench.disk import kv_like_bytes
from kvtier.config.settings import DiskFloor
from kvtier.disk.tier import DiskTier
from kvtier.io.buffers import PAGE
from kvtier.keys import ChunkKey, Namespace
from kvtier.tiers.host import HostTier
from kvtier.units import parse_size


def measure(directory: Path, chunk: int, total: int, depth: int, passes: int = 5) -> dict:
    count = total // chunk
    host = HostTier(count, -(-chunk // PAGE) * PAGE)
    work = Path(tempfile.mkdtemp(prefix="kvtier-ceiling-", dir=directory))
    disk, raw = None, -1
    try:
        host.buffer.array[:] = kv_like_bytes(host.buffer.size)
        stride = PAGE + host.slot_bytes
        namespace = Namespace(model="ceiling", kv_dtype="bfloat16", layout=f"ceiling:{chunk}",
                              block_tokens=1, chunk_tokens=1)
        (work / "tier").mkdir(mode=0o700)
        disk = DiskTier([str(work / "tier")], namespace, chunk, count * stride, o_direct=True,
                        floor=DiskFloor())
        keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(count)]
        raw = os.open(work / "bare.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(raw, 0, count * stride)
        header = host.buffer.array[:PAGE]  # any page-aligned 4 KiB stands for the header

        def bare(i: int) -> None:
            os.pwritev(raw, [header, host.slot_array(i)], i * stride)

        def checksummed(i: int) -> None:
            xxhash.xxh3_64_intdigest(host.slot_array(i)[:chunk])
            os.pwritev(raw, [header, host.slot_array(i)], i * stride)

        def tier(i: int) -> None:
            (result,) = disk.write_many([(i, keys[i], host.slot_array(i))])
            assert result.ok, result

        ways = {"bare": bare, "checksummed": checksummed, "disk tier": tier}
        best = dict.fromkeys(ways, 0.0)
        with ThreadPoolExecutor(depth) as pool:
            for way in ways.values():  # lay the files out: the timed passes overwrite
                list(pool.map(way, range(count)))
            for _ in range(passes):
                for name, way in ways.items():
                    start = time.perf_counter()
                    list(pool.map(way, range(count)))
                    best[name] = max(best[name], count * chunk / 2**30 / (time.perf_counter() - start))
    finally:
        if raw >= 0:
            os.close(raw)
        if disk is not None:
            disk.close()
        host.close()
        shutil.rmtree(work)
    return {"chunk_bytes": chunk, "depth": depth, "bytes": count * chunk,
            **{f"{name.replace(' ', '_')}_gib_s": value for name, value in best.items()},
            "tier_vs_checksummed": best["disk tier"] / best["checksummed"],
            "checksummed_vs_bare": best["checksummed"] / best["bare"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--size", default="2GiB", help="bytes per pass (default 2GiB)")
    parser.add_argument("--chunks", default="2MiB,32MiB")
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [measure(args.dir, parse_size(c), parse_size(args.size), args.depth)
            for c in args.chunks.split(",")]
    print("| chunk | depth | bare GiB/s | checksummed GiB/s | disk tier GiB/s "
          "| checksummed/bare | disk tier/checksummed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['chunk_bytes'] >> 20} MiB | {r['depth']} | {r['bare_gib_s']:.2f} "
              f"| {r['checksummed_gib_s']:.2f} | {r['disk_tier_gib_s']:.2f} "
              f"| {r['checksummed_vs_bare']:.2f} | {r['tier_vs_checksummed']:.2f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
