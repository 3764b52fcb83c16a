"""``KVStore`` as a user calls it, against fio and ``numpy.copyto`` on the same machine, in one run.

    scripts/ramdisk.sh up /mnt/kvtier-ram 8G
    .venv/bin/python scripts/bench_store.py --dir /mnt/kvtier-ram --chunks 1MiB,2MiB,32MiB \\
        --json out/bench_store.json

For each chunk size: ``put`` 2 GiB of prefixes (8 chunks each, Llama-3-8B layout) into a store
with 512 MiB of host memory and its disk on ``--dir``, then ``flush()`` (put + flush); close,
open a new store on the same directory, page cache dropped, and ``get`` every prefix into the
caller's tensor (one tensor per prefix size, reused, as a serving engine reuses its buffers;
every byte checked). Against fio's best read and write on the same directory with I/Os of the
chunk's size (over libaio and psync, queue depths 1 to 32). Host only: the same prefixes put
and got with every chunk in host memory, against ``numpy.copyto`` of the same bytes into and
out of memory the size of the store's host slots. Best of ``--passes``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from kvtier import KVLayout, KVStore
from kvtier.bench.fio import fio_bandwidth, have_fio
from kvtier.bench.naive import drop_page_cache
from kvtier.config_values import parse_size

LAYOUT = KVLayout(num_layers=32, kv_heads=8, head_size=128, dtype="bfloat16")
PREFIX_CHUNKS = 8
FIO_DEPTHS = (1, 4, 8, 16, 32)


class Workload:
    """``count`` prefixes of ``PREFIX_CHUNKS`` chunks, each its own tokens, one KV tensor
    (the bytes are the same for every prefix; the keys are not)."""

    def __init__(self, chunk_bytes: int, total: int) -> None:
        self.chunk_tokens = chunk_bytes // LAYOUT.token_bytes
        self.prefix_tokens = self.chunk_tokens * PREFIX_CHUNKS
        self.count = max(1, total // (chunk_bytes * PREFIX_CHUNKS))
        self.bytes = self.count * self.prefix_tokens * LAYOUT.token_bytes
        self.kv = torch.randn(LAYOUT.shape(self.prefix_tokens)).to(torch.bfloat16)
        self.out = torch.zeros_like(self.kv)  # touched once: no page faults in the timing

    def tokens(self, i: int) -> list[int]:
        return list(range(i * self.prefix_tokens, (i + 1) * self.prefix_tokens))

    def config(self, host: int, disk: Path | None) -> dict:
        cfg = {"chunk_tokens": self.chunk_tokens, "host_capacity": host, "disk_min_free": 0}
        if disk is not None:
            cfg.update(disk_paths=[str(disk)], disk_capacity=int(self.bytes * 1.3) + 2**30)
        return cfg


def put_all(store: KVStore, work: Workload) -> float:
    start = time.perf_counter()
    for i in range(work.count):
        store.put(work.tokens(i), work.kv)
    return time.perf_counter() - start


def get_all(store: KVStore, work: Workload) -> float:
    seconds = 0.0
    for i in range(work.count):
        start = time.perf_counter()
        got = store.get(work.tokens(i), work.out)
        seconds += time.perf_counter() - start
        assert got == work.prefix_tokens, f"prefix {i}: {got} of {work.prefix_tokens} tokens"
        assert torch.equal(work.out.view(torch.int16), work.kv.view(torch.int16)), "wrong bytes"
    return seconds


def disk_pass(work: Workload, root: Path) -> tuple[float, float]:
    """GiB/s of put + flush, and of get after a restart."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cfg = work.config(512 * 2**20, root)
    with KVStore(LAYOUT, cfg, model="bench") as store:
        start = time.perf_counter()
        put_all(store, work)
        flushed = store.flush()
        put_s = time.perf_counter() - start
        assert flushed, flushed
    drop_page_cache()
    with KVStore(LAYOUT, cfg, model="bench") as store:
        get_s = get_all(store, work)
    gib = work.bytes / 2**30
    return gib / put_s, gib / get_s


def host_pass(work: Workload) -> tuple[float, float, float, float]:
    """GiB/s of host-only put and get, and of ``numpy.copyto`` of the same bytes into and
    out of memory the size of the store's host slots (not a cache-resident copy)."""
    cfg = work.config(work.bytes + 2**30, None)
    with KVStore(LAYOUT, cfg, model="bench") as store:
        put_all(store, work)  # the first pass faults the host slots in
    with KVStore(LAYOUT, cfg, model="bench") as store:
        put_s = put_all(store, work)
        get_s = get_all(store, work)
    src = work.kv.view(torch.uint8).numpy().reshape(-1)
    out = work.out.view(torch.uint8).numpy().reshape(-1)
    pool = np.ones((work.count, src.size), dtype=np.uint8)  # touched: faulted in
    start = time.perf_counter()
    for i in range(work.count):
        np.copyto(pool[i], src)
    copy_in_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(work.count):
        np.copyto(out, pool[i])
    copy_out_s = time.perf_counter() - start
    gib = work.bytes / 2**30
    return gib / put_s, gib / get_s, gib / copy_in_s, gib / copy_out_s


def fio_best(directory: Path, chunk_bytes: int, total: int) -> tuple[float | None, float | None]:
    if not have_fio():
        return None, None
    size = min(total, 2**30)
    write = max(fio_bandwidth(directory, "write", chunk_bytes, size, d) for d in FIO_DEPTHS)
    read = max(fio_bandwidth(directory, "read", chunk_bytes, size, d) for d in FIO_DEPTHS)
    return write, read


def measure(directory: Path, chunk_bytes: int, total: int, passes: int) -> dict:
    work = Workload(chunk_bytes, total)
    root = directory / "kvtier-bench-store"
    best = {"put_flush": 0.0, "get": 0.0, "host_put": 0.0, "host_get": 0.0, "copyto_in": 0.0,
            "copyto_out": 0.0}
    try:
        for _ in range(passes):
            put_flush, get = disk_pass(work, root)
            figures = (put_flush, get, *host_pass(work))
            for name, value in zip(best, figures, strict=True):
                best[name] = max(best[name], value)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fio_write, fio_read = fio_best(directory, chunk_bytes, work.bytes)
    row: dict = {"chunk_bytes": chunk_bytes, "bytes": work.bytes, **best,
                 "fio_write": fio_write, "fio_read": fio_read}
    if fio_write and fio_read:
        row["put_flush_vs_fio"], row["get_vs_fio"] = best["put_flush"] / fio_write, best["get"] / fio_read
    row["host_put_vs_copyto"] = best["host_put"] / best["copyto_in"]
    row["host_get_vs_copyto"] = best["host_get"] / best["copyto_out"]
    return row


def print_table(rows: list[dict]) -> None:
    print("| chunk | put+flush GiB/s | fio write | put+flush/fio | get GiB/s | fio read | get/fio "
          "| host put/copyto | host get/copyto |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fio = (f"{r['fio_write']:.2f} | {r['put_flush_vs_fio']:.2f}", f"{r['fio_read']:.2f} | "
               f"{r['get_vs_fio']:.2f}") if r.get("fio_read") else ("- | -", "- | -")
        print(f"| {r['chunk_bytes'] >> 20} MiB | {r['put_flush']:.2f} | {fio[0]} | {r['get']:.2f} | "
              f"{fio[1]} | {r['host_put_vs_copyto']:.2f} | {r['host_get_vs_copyto']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="a directory on the device")
    parser.add_argument("--chunks", default="1MiB,2MiB,32MiB")
    parser.add_argument("--size", default="2GiB", help="bytes put per pass")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    total = parse_size(args.size)
    rows = []
    for chunk in args.chunks.split(","):
        rows.append(measure(args.dir, parse_size(chunk), total, args.passes))
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
