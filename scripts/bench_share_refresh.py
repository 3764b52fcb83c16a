"""What following other writers on a shared directory costs: 64 writers' segments of one
namespace, each holding CHUNKS chunks; one reader's ``SharedView`` follows them all.

    .venv/bin/python scripts/bench_share_refresh.py [--writers 64] [--chunks 2000] \
        [--dir /tmp] [--json out/bench_share_refresh.json]

Reports, side by side in one run: the first refresh of a reader that just started, and the
refreshes it takes to read every log from its start (one refresh reads at most
``REFRESH_BYTES`` of log a path), a refresh with nothing new, a refresh after each writer wrote
``--appended`` more chunks, and, for comparison, reading every writer's dense index whole
(what a refresh would cost if it were not incremental). Chunks are small (4 KiB): only the
metadata is measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from kvtier.disk.tier import DiskTier
from kvtier.io.buffers import AlignedBuffer
from kvtier.keys import ChunkKey, Namespace
from kvtier.segment.index_file import SlotLayout, read_disk_index
from kvtier.shared.view import SharedView

RAW = 4096
NS = Namespace(model="bench/share", kv_dtype="bfloat16", layout="LKTH", block_tokens=16,
               chunk_tokens=16)


def key(writer: int, n: int) -> ChunkKey:
    return ChunkKey(writer.to_bytes(4, "little") + n.to_bytes(12, "little"))


def timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=2000, help="chunks per writer")
    parser.add_argument("--appended", type=int, default=10, help="chunks per writer between refreshes")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where to make the run's scratch directory (removed at the end)")
    parser.add_argument("--json")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvtier-share-", dir=args.dir))  # ours alone
    layout = SlotLayout(RAW, 1, 4 * args.chunks * (4096 + RAW))
    data = AlignedBuffer(RAW, pin=False)
    tiers = [DiskTier([str(root)], NS, RAW, layout.capacity, o_direct=False,
                      writers=[f"w{i:03d}"], share_writers=args.writers)
             for i in range(args.writers)]
    for w, tier in enumerate(tiers):
        tier.write_many([(s, key(w, s), data.array) for s in range(args.chunks)])
    view = SharedView([str(root)], NS, RAW, own=("reader",), lease_timeout=30)
    first = timed(view.refresh)
    first_bytes = view.bytes_read
    catch_up, catch_up_refreshes = first, 1
    while True:  # one refresh reads at most REFRESH_BYTES of log a path: the rest follows
        read = view.bytes_read
        took = timed(view.refresh)
        if view.bytes_read == read:
            break
        catch_up, catch_up_refreshes = catch_up + took, catch_up_refreshes + 1
    first_all_bytes = view.bytes_read
    idle = timed(view.refresh)
    idle_bytes = view.bytes_read - first_all_bytes
    for w, tier in enumerate(tiers):
        start = args.chunks
        tier.write_many([(s, key(w, s), data.array) for s in range(start, start + args.appended)])
    before = view.bytes_read
    appended = timed(view.refresh)
    appended_bytes = view.bytes_read - before
    whole = timed(lambda: [read_disk_index([str(root)], NS, layout, f"w{i:03d}")
                           for i in range(args.writers)])
    assert len(view) == args.writers * (args.chunks + args.appended), len(view)
    result = {"writers": args.writers, "chunks_per_writer": args.chunks,
              "appended_per_writer": args.appended, "first_refresh_s": first,
              "first_refresh_bytes": first_bytes, "catch_up_s": catch_up,
              "catch_up_refreshes": catch_up_refreshes, "catch_up_bytes": first_all_bytes,
              "idle_refresh_s": idle,
              "idle_refresh_bytes": idle_bytes, "appended_refresh_s": appended,
              "appended_refresh_bytes": appended_bytes, "whole_index_reread_s": whole,
              "appended_over_whole": appended / whole}
    for name, value in result.items():
        print(f"{name:24s} {value:.4g}" if isinstance(value, float) else f"{name:24s} {value}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    view.close()
    for tier in tiers:
        tier.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
