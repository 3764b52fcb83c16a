"""The vLLM worker's load path end to end: chunks read from disk after a restart, verified,
and scattered into a paged KV cache, per second, against fio's best read on the same device.

    scripts/ramdisk.sh up /mnt/kvtier-ram 8G
    .venv/bin/python scripts/bench_worker_load.py --dir /mnt/kvtier-ram --chunk-tokens 16,256 \\
        --json out/bench_worker_load.json

A synthetic paged cache with Llama-3-8B's shape on one rank (32 layers, 8 KV heads, 128 dims,
bf16, 16-token blocks) is stored to disk through ``WorkerSide.save`` (2 GiB); a new
``WorkerSide`` (a restart) then loads every chunk into a zeroed cache, ``--request-chunks``
chunks per request, all requests started together as vLLM starts a step's loads, and waits
for ``finished()``: disk reads, checks, and the host-to-page scatter. Every page is compared
with the stored one afterwards. fio: the better of libaio and psync at depths 1-32, I/Os of
the chunk's size. Best of ``--passes``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from kvtier.bench.fio import fio_bandwidth, have_fio
from kvtier.bench.naive import drop_page_cache
from kvtier.config.settings import load_config
from kvtier.config.values import parse_size
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import ChunkLoad, ChunkStore, RequestLoad, StepPlan
from kvtier.connector.worker.side import WorkerSide

LAYERS, HIDDEN, BLOCK = 32, 8 * 128, 16
FIO_DEPTHS = (1, 4, 8, 16, 32)


def geometry(chunk_tokens: int) -> KVGeometry:
    return KVGeometry(LAYERS, 2 * BLOCK * HIDDEN * 2, BLOCK, BLOCK, chunk_tokens, "bfloat16",
                      "(blocks, 2, block_tokens, hidden)")


def worker(geo: KVGeometry, root: Path, chunks: int, host_slots: int,
           kv: list[torch.Tensor]) -> WorkerSide:
    config = load_config({"chunk_tokens": geo.chunk_tokens, "host_capacity": host_slots * (
        geo.chunk_bytes + 4096), "disk_paths": [str(root)], "disk_capacity": chunks * (
            geo.chunk_bytes + 8192), "disk_min_free": 0}, environ={})
    side = WorkerSide(config, geo, geo.namespace("bench", "", 1, 0))
    side.register({f"layer{i}": t for i, t in enumerate(kv)})
    return side


def blocks_of(geo: KVGeometry, chunk: int) -> tuple[int, ...]:
    per = geo.blocks_per_chunk
    return tuple(range(1 + chunk * per, 1 + (chunk + 1) * per))  # block 0: vLLM's null block


def store_all(geo: KVGeometry, root: Path, chunks: int, host_slots: int,
              kv: list[torch.Tensor]) -> None:
    side = worker(geo, root, chunks, host_slots, kv)
    for first in range(0, chunks, host_slots):  # a host slot is reused once its write is over
        batch = range(first, min(chunks, first + host_slots))
        side.save(StepPlan(stores=[ChunkStore(key(c), blocks_of(geo, c), c - first, disk_slot=c)
                                   for c in batch]))
        side.drain()
    written = side.report()
    assert written is not None and written.disk_written.total() == chunks, "stores failed"
    assert side.close()


def key(chunk: int) -> bytes:
    return chunk.to_bytes(16, "little")


def load_all(geo: KVGeometry, root: Path, chunks: int, per_request: int,
             kv: list[torch.Tensor]) -> float:
    """Seconds from starting every load to the last one finished."""
    side = worker(geo, root, chunks, chunks, kv)
    loads = [RequestLoad(f"r{first}", tuple(
        ChunkLoad(key(c), blocks_of(geo, c), 0, host_slot=c, disk_slot=c)
        for c in range(first, min(chunks, first + per_request))), asynchronous=True)
        for first in range(0, chunks, per_request)]
    waiting = {load.req_id for load in loads}
    start = time.perf_counter()
    side.start_loads(StepPlan(loads=loads))
    while waiting:
        waiting -= side.finished()
        time.sleep(0.0002)
    seconds = time.perf_counter() - start
    assert not side.take_invalid_blocks(), "a load failed"
    assert side.close()
    return seconds


def measure(directory: Path, chunk_tokens: int, total: int, per_request: int,
            passes: int) -> dict:
    geo = geometry(chunk_tokens)
    chunks = max(1, total // geo.chunk_bytes)
    blocks = 1 + chunks * geo.blocks_per_chunk
    source = [torch.randn(blocks, 2, BLOCK, HIDDEN).to(torch.bfloat16) for _ in range(LAYERS)]
    target = [torch.zeros_like(t) for t in source]
    root = directory / "kvtier-bench-worker"
    best = 0.0
    try:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        store_all(geo, root, chunks, min(chunks, 16), source)
        for _ in range(passes):
            for t in target:
                t.zero_()
            drop_page_cache()
            best = max(best, chunks * geo.chunk_bytes / 2**30 / load_all(
                geo, root, chunks, per_request, target))
            assert all(torch.equal(a[1:].view(torch.int16), b[1:].view(torch.int16))
                       for a, b in zip(source, target, strict=True)), "wrong pages"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fio = max(fio_bandwidth(directory, "read", geo.chunk_bytes, min(total, 2**30), d)
              for d in FIO_DEPTHS) if have_fio() else None
    return {"chunk_tokens": chunk_tokens, "chunk_bytes": geo.chunk_bytes, "chunks": chunks,
            "request_chunks": per_request, "load_gib_s": best, "fio_read_gib_s": fio,
            "load_vs_fio": best / fio if fio else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="a directory on the device")
    parser.add_argument("--chunk-tokens", default="16,256")
    parser.add_argument("--size", default="2GiB")
    parser.add_argument("--request-chunks", type=int, default=8)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [measure(args.dir, int(c), parse_size(args.size), args.request_chunks, args.passes)
            for c in args.chunk_tokens.split(",")]
    print("| chunk | requests of | load GiB/s | fio read GiB/s | load/fio |")
    print("|---|---|---|---|---|")
    for r in rows:
        fio = f"{r['fio_read_gib_s']:.2f} | {r['load_vs_fio']:.2f}" if r["fio_read_gib_s"] else "- | -"
        print(f"| {r['chunk_bytes'] >> 20} MiB ({r['chunk_tokens']} tokens) | {r['request_chunks']} "
              f"chunks | {r['load_gib_s']:.2f} | {fio} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
