"""Disk and remote hits of sliding-window models through the vLLM worker's load path: chunks
read whole against only the KV cache groups' parts the hit fills, side by side in one run.

    scripts/ramdisk.sh up /mnt/kvtier-ram 8G
    .venv/bin/python scripts/bench_window_load.py --dir /mnt/kvtier-ram --json out/bench_window_load.json

With ``--remote`` the same hits come from a redis-server this script starts on 127.0.0.1 (no
persistence), the bytes read from the server's own count of bytes sent.

Two synthetic paged caches on one rank (8 KV heads, 128 dims, bf16, 16-token blocks, 256-token
chunks, a 1024-token window), each stored to disk through ``WorkerSide.save`` and loaded back
by a new ``WorkerSide`` (a restart) as one request's hit of ``--tokens``:

- hybrid (Gemma-3's 5:1): 24 layers in six KV cache groups of 4, one full-attention and five
  sliding-window; a chunk out of the window needs only the full group's part;
- sliding (Mistral's): 24 sliding-window layers in one group; a chunk out of the window needs
  nothing.

The hit is planned as the scheduler side plans it (vLLM's null block where a group keeps no
block), read two ways in alternating passes: "whole" reads every chunk whole (as before parts),
"parts" reads only the parts a chunk fills (and no chunk that fills nothing). Each pass starts
with the page cache dropped; every page the hit fills is compared with the stored one. Best of
``--passes`` per way, the bytes read from ``disk_read_bytes``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from kvtier.bench.naive import drop_page_cache
from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import NULL_BLOCK, ChunkLoad, ChunkStore, RequestLoad, StepPlan
from kvtier.connector.worker.side import WorkerSide

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.redis_server import RedisServer

HIDDEN, BLOCK, CHUNK, WINDOW, LAYERS = 8 * 128, 16, 256, 1024, 24
SHAPES = {"hybrid": (("full",) + ("sliding1024",) * 5, (4,) * 6),
          "sliding": (("sliding1024",), ())}


def geometry(kind: str) -> KVGeometry:
    kinds, groups = SHAPES[kind]
    return KVGeometry(LAYERS, 2 * BLOCK * HIDDEN * 2, BLOCK, BLOCK, CHUNK, "bfloat16",
                      "(blocks, 2, block_tokens, hidden)", group_layers=groups,
                      group_kinds=kinds)


def bytes_sent(server: RedisServer) -> int:
    """The server's own count of the bytes it has sent to clients."""
    return int(server.client().info("stats")["total_net_output_bytes"])


def worker(geo: KVGeometry, root: Path, chunks: int, kv: list[torch.Tensor],
           remote: RedisServer | None = None) -> WorkerSide:
    extra = {"remote_url": remote.url, "remote_timeout": "30s"} if remote is not None else {}
    config = load_config({"chunk_tokens": CHUNK, "host_capacity": chunks * (geo.chunk_bytes + 4096),
                          "disk_paths": [str(root)], "disk_capacity": chunks * (
                              geo.chunk_bytes + 8192), "disk_min_free": 0, **extra}, environ={})
    side = WorkerSide(config, geo, geo.namespace("bench", "", 1, 0))
    side.register({f"layer{i}": t for i, t in enumerate(kv)})
    return side


def key(chunk: int) -> bytes:
    return chunk.to_bytes(16, "little")


def block_ids(geo: KVGeometry, chunk: int, end: int) -> tuple[int, ...]:
    """Chunk ``chunk``'s blocks in every group (group g's blocks after group g-1's), the null
    block where the group keeps none for a hit ending at token ``end``."""
    per = geo.blocks_per_chunk
    ids = []
    for first in geo.kept_from(end):  # each group's layers have tensors of their own
        for b in range(chunk * per, (chunk + 1) * per):
            kept = (b + 1) * BLOCK > first
            ids.append(1 + b if kept else NULL_BLOCK)  # block 0: the null block
    return tuple(ids)


def stored_ids(geo: KVGeometry, chunk: int) -> tuple[int, ...]:
    return block_ids(geo, chunk, 0)  # every group keeps every block


def store_all(geo: KVGeometry, root: Path, chunks: int, kv: list[torch.Tensor],
              remote: RedisServer | None) -> None:
    side = worker(geo, root, chunks, kv, remote)
    side.save(StepPlan(stores=[ChunkStore(key(c), stored_ids(geo, c), c, disk_slot=c,
                                          remote=remote is not None) for c in range(chunks)]))
    side.drain()
    written = side.report()
    assert written is not None and written.disk_written.total() == chunks, "stores failed"
    if remote is not None:
        put = written.remote_written.total()
        side.drain()
        later = side.report()
        put += later.remote_written.total() if later is not None else 0
        assert put == chunks, f"{chunks - put} remote puts failed"
    assert side.close()


def load(geo: KVGeometry, root: Path, chunks: int, kv: list[torch.Tensor],
         in_part: bool, remote: RedisServer | None) -> tuple[float, int]:
    """(seconds, bytes read) of one request's hit of every chunk."""
    side = worker(geo, root, chunks, kv, remote)
    end = chunks * CHUNK
    loads = []
    for c in range(chunks):
        ids = block_ids(geo, c, end)
        if in_part and all(b == NULL_BLOCK for b in ids):
            loads.append(ChunkLoad(key(c), ids, 0, None))
        else:
            parts = geo.groups_filled(ids) if in_part else None  # as the planner
            where = {"remote": True} if remote is not None else {"disk_slot": c}
            loads.append(ChunkLoad(key(c), ids, 0, host_slot=c, parts=parts, **where))
    request = RequestLoad("hit", tuple(loads), asynchronous=True)
    sent = bytes_sent(remote) if remote is not None else 0
    start = time.perf_counter()
    side.start_loads(StepPlan(loads=[request]))
    while "hit" not in side.finished():
        time.sleep(0.0002)
    seconds = time.perf_counter() - start
    assert not side.take_invalid_blocks() and not side.take_failed_loads(), "the load failed"
    stats = side.stats()
    assert side.close()
    if remote is not None:
        return seconds, bytes_sent(remote) - sent
    return seconds, stats.data["disk_read_bytes"] if stats else 0


def filled_right(geo: KVGeometry, chunks: int, source: list[torch.Tensor],
                 target: list[torch.Tensor]) -> bool:
    """Whether every block the hit fills holds the stored page, in every layer of its group."""
    end, layer = chunks * CHUNK, 0
    for g, count in enumerate(geo.groups):
        kept = []
        for c in range(chunks):
            ids = block_ids(geo, c, end)
            per = len(ids) // len(geo.groups)
            kept += [b for b in ids[g * per:(g + 1) * per] if b != NULL_BLOCK]
        for a, b in zip(source[layer:layer + count], target[layer:layer + count], strict=True):
            if not torch.equal(a[kept].view(torch.int16), b[kept].view(torch.int16)):
                return False
        layer += count
    return True


def measure(directory: Path, kind: str, tokens: int, passes: int, remote: bool) -> dict:
    geo = geometry(kind)
    chunks = tokens // CHUNK
    blocks = 1 + chunks * geo.blocks_per_chunk
    source = [torch.randn(blocks, 2, BLOCK, HIDDEN).to(torch.bfloat16) for _ in range(LAYERS)]
    target = [torch.zeros_like(t) for t in source]
    root = directory / "kvtier-bench-window"
    best: dict[bool, tuple[float, int]] = {}
    server = RedisServer(directory / "kvtier-bench-redis").start() if remote else None
    try:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        store_all(geo, root, chunks, source, server)
        for _ in range(passes):
            for in_part in (False, True):
                for t in target:
                    t.zero_()
                drop_page_cache()
                seconds, read = load(geo, root, chunks, target, in_part, server)
                if in_part not in best or seconds < best[in_part][0]:
                    best[in_part] = (seconds, read)
                assert filled_right(geo, chunks, source, target), "wrong pages"
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    (whole_s, whole_b), (part_s, part_b) = best[False], best[True]
    return {"model": kind, "from": "remote" if remote else "disk", "tokens": tokens,
            "chunk_mib": geo.chunk_bytes / 2**20,
            "whole_s": whole_s, "whole_mib": whole_b / 2**20, "parts_s": part_s,
            "parts_mib": part_b / 2**20, "parts_vs_whole": part_s / whole_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="a directory on the device")
    parser.add_argument("--tokens", default="4096,16384", help="hit lengths (multiples of 256)")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--remote", action="store_true",
                        help="hits from a redis-server started here instead of the disk")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [measure(args.dir, kind, int(t), args.passes, args.remote) for kind in SHAPES
            for t in args.tokens.split(",")]
    print("| model | from | hit tokens | whole: s (MiB read) | parts: s (MiB read) | parts / whole |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['from']} | {r['tokens']} | {r['whole_s']:.3f} ({r['whole_mib']:.0f}) | "
              f"{r['parts_s']:.3f} ({r['parts_mib']:.0f}) | {r['parts_vs_whole']:.2f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
