"""Start-up time of a store whose disk tier holds N chunks (default 100,000).

    python scripts/bench_recovery.py --dir /mnt/kvtier-ram [--chunks 100000]

Writes N chunks through the disk tier, then times opening a KVStore on them (index
recovery into the bookkeeping), and the same with the index file removed (a full scan of
every slot header, which rebuilds the index). Both in one run, on the same directory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from kvtier import KVLayout, KVStore
from kvtier.config.settings import DiskFloor
from kvtier.disk.tier import DiskTier
from kvtier.io.buffers import AlignedBuffer
from kvtier.io.engine import IOEngine

# 1 layer, 1 head of 64 dims in bf16, 64-token chunks: 16 KiB per chunk, so that 100k
# chunks fit a RAM disk; start-up cost depends on the number of chunks, not their size.
LAYOUT = KVLayout(num_layers=1, kv_heads=1, head_size=64, dtype="bfloat16")
CHUNK_TOKENS = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvtier-recovery-", dir=args.dir))
    chunk_bytes = LAYOUT.token_bytes * CHUNK_TOKENS
    stride = 4096 + chunk_bytes
    config = {"chunk_tokens": CHUNK_TOKENS, "host_capacity": "64MiB", "disk_paths": [str(work)],
              "disk_capacity": args.chunks * stride, "disk_min_free": 0, "model": "model"}
    namespace = LAYOUT.namespace("model", CHUNK_TOKENS)
    try:
        disk = DiskTier([str(work)], namespace, chunk_bytes, args.chunks * stride, floor=DiskFloor())
        engine = IOEngine(disk.queues, 8)
        payload = AlignedBuffer(chunk_bytes, pin=False)
        start = time.perf_counter()
        futures = [engine.submit("disk0", lambda i=i: disk.write(i, i.to_bytes(16, "little"),
                                                                 payload.array))
                   for i in range(args.chunks)]
        assert all(f.result().ok for f in futures)
        write_s = time.perf_counter() - start
        engine.close()
        disk.close()

        def open_store() -> float:
            start = time.perf_counter()
            store = KVStore(LAYOUT, config)
            elapsed = time.perf_counter() - start
            assert store.stats().recovered_chunks == args.chunks, store.stats()
            store.close()
            return elapsed

        from_index = min(open_store() for _ in range(3))
        (work / namespace.id / "index.kvt").unlink()
        full_scan = open_store()  # rebuilds the index
        again = open_store()
    finally:
        shutil.rmtree(work)
    result = {"chunks": args.chunks, "write_s": write_s, "open_from_index_s": from_index,
              "open_full_scan_s": full_scan, "open_after_rebuild_s": again,
              "scan_vs_index": full_scan / from_index}
    print(f"{args.chunks} chunks on {args.dir}: open with index {from_index:.2f} s, with a full "
          f"header scan {full_scan:.2f} s ({full_scan / from_index:.1f}x), after the scan "
          f"rebuilt the index {again:.2f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
