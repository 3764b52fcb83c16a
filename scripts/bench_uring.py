"""io_uring (the PyPI ``liburing`` binding) against kvtier's thread engine, on the same slot reads.

    pip install liburing
    python scripts/bench_uring.py --dir /mnt/kvtier-ram [--sizes 256KiB,2MiB,32MiB] [--depths 8,16]

For each chunk size: a slot file is written through the disk tier, then read back (page cache
dropped before each pass) by (a) the disk tier on the thread engine without payload checks,
(b) io_uring ``readv`` of each slot's header and payload at the same queue depth from one
thread, and (c) both again while a pure-Python thread keeps the interpreter busy, as a serving
engine's loop does. Best of three passes each; ratios are io_uring over the thread engine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvtier.bench.disk import kv_like_bytes
from kvtier.bench.naive import drop_cache
from kvtier.config.settings import DiskFloor
from kvtier.disk.tier import DiskTier
from kvtier.io.buffers import AlignedBuffer
from kvtier.io.engine import IOEngine
from kvtier.keys import ChunkKey, Namespace
from kvtier.tiers.host import HostTier
from kvtier.units import format_size, parse_size

HEADER = 4096


def uring_read_s(path: Path, chunk: int, stride: int, count: int, depth: int,
                 buffers: list[AlignedBuffer]) -> float:
    """Seconds to read ``count`` slots (header + payload) with ``depth`` reads in flight."""
    import liburing as lu

    ring, cqe = lu.Ring(), lu.Cqe()
    lu.io_uring_queue_init(2 * depth, ring)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    iovecs = [lu.Iovec([memoryview(b.array[:HEADER]), memoryview(b.array[HEADER:HEADER + chunk])])
              for b in buffers]
    try:
        start = time.perf_counter()
        issued = done = 0
        free = list(range(depth))
        while done < count:
            while free and issued < count:
                slot = free.pop()
                sqe = lu.io_uring_get_sqe(ring)
                lu.io_uring_prep_readv(sqe, fd, iovecs[slot], issued * stride)
                sqe.user_data = slot
                issued += 1
            lu.io_uring_submit(ring)
            lu.io_uring_wait_cqe(ring, cqe)
            while True:  # one completion at a time: cqe[i > 0] reads zeros past the ring's end
                entry = cqe[0]
                res, slot = entry.res, entry.user_data
                if res != HEADER + chunk:
                    raise OSError(-res if res < 0 else 0, f"io_uring read of {HEADER + chunk} bytes "
                                  f"got {res}")
                free.append(slot)
                lu.io_uring_cq_advance(ring, 1)
                done += 1
                if not lu.io_uring_cq_ready(ring):
                    break
                lu.io_uring_peek_cqe(ring, cqe)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        lu.io_uring_queue_exit(ring)


def busy(stop: threading.Event) -> None:
    """A pure-Python loop, as a serving engine's scheduler keeps one thread busy."""
    n = 0
    while not stop.is_set():
        n += 1


def measure(directory: Path, chunk: int, total: int, depth: int) -> dict:
    count = max(depth, total // chunk)
    host = HostTier(count, HEADER + chunk)
    namespace = Namespace(model="bench", kv_dtype="bfloat16", layout=f"uring:{chunk}",
                          block_tokens=1, chunk_tokens=1)
    work = Path(tempfile.mkdtemp(prefix="kvtier-uring-", dir=directory))
    disk = DiskTier([str(work)], namespace, chunk, count * (HEADER + host.slot_bytes),
                    o_direct=True, floor=DiskFloor(), verify_payload=False)
    engine = IOEngine(disk.queues, depth)
    keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(count)]
    data = kv_like_bytes(chunk)
    buffers = [AlignedBuffer(HEADER + chunk, pin=False) for _ in range(depth)]
    try:
        for i in range(count):
            host.slot_array(i)[:chunk] = data
        futures = [engine.submit(disk.queue_of(i), lambda i=i: disk.write(i, keys[i], host.slot_array(i)))
                   for i in range(count)]
        assert all(f.result().ok for f in futures)
        (slots,) = work.glob("*/slots-*.kvt")
        stride = disk.stride

        def threads() -> float:
            start = time.perf_counter()
            per = -(-count // depth)
            jobs = [engine.submit(disk.queue_of(0), lambda s=s: disk.read_many(
                [(i, keys[i], host.slot_array(i)) for i in range(s, min(s + per, count))]))
                for s in range(0, count, per)]
            assert all(r.ok for job in jobs for r in job.result())
            return time.perf_counter() - start

        def uring() -> float:
            return uring_read_s(slots, chunk, stride, count, depth, buffers)

        out = {"chunk_bytes": chunk, "depth": depth, "gib": count * chunk / 2**30}
        for name, run in (("threads", threads), ("uring", uring)):
            for loaded in (False, True):
                best = float("inf")
                for _ in range(3):
                    drop_cache([slots])
                    stop = threading.Event()
                    spinner = threading.Thread(target=busy, args=(stop,))
                    if loaded:
                        spinner.start()
                    try:
                        best = min(best, run())
                    finally:
                        stop.set()
                        if loaded:
                            spinner.join()
                out[f"{name}{'_busy' if loaded else ''}_gib_s"] = out["gib"] / best
        out["uring_vs_threads"] = out["uring_gib_s"] / out["threads_gib_s"]
        out["uring_vs_threads_busy"] = out["uring_busy_gib_s"] / out["threads_busy_gib_s"]
        return out
    finally:
        engine.close()
        disk.close()
        host.close()
        for b in buffers:
            b.close()
        shutil.rmtree(work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--sizes", default="256KiB,2MiB,32MiB")
    parser.add_argument("--depths", default="8,16")
    parser.add_argument("--total", default="2GiB")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        import liburing  # noqa: F401
    except ImportError:
        sys.exit("needs the io_uring binding: pip install liburing")
    sys.setswitchinterval(0.0005)  # as the vLLM worker sets it
    rows = [measure(args.dir, parse_size(size), parse_size(args.total), int(depth))
            for size in args.sizes.split(",") for depth in args.depths.split(",")]
    print(f"{'chunk':>8} {'depth':>5} {'threads':>8} {'io_uring':>9} {'ratio':>6} "
          f"{'threads*':>9} {'io_uring*':>10} {'ratio*':>7}   (GiB/s; * = a busy Python thread)")
    for r in rows:
        print(f"{format_size(r['chunk_bytes']):>8} {r['depth']:>5} {r['threads_gib_s']:>8.2f} "
              f"{r['uring_gib_s']:>9.2f} {r['uring_vs_threads']:>6.2f} {r['threads_busy_gib_s']:>9.2f} "
              f"{r['uring_busy_gib_s']:>10.2f} {r['uring_vs_threads_busy']:>7.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
