"""The remote tier's Redis backend, and ``KVStore`` over it, against the raw client on the
same server, in one run.

    python scripts/bench_remote.py                       # a redis-server of its own, loopback
    python scripts/bench_remote.py --url redis://127.0.0.1:6379/0 --chunks 2MiB,32MiB

For each chunk size: ``--size`` bytes of chunks put with ``RedisTier.put_many`` and read
back with ``get_many`` (every value framed, checked down to its checksum, copied into a
caller's buffer), ``--batch`` chunks a round trip; against redis-py's own pipelined SET and
GET of values of the same size (nothing checked, nothing copied) on the same server. The
store arms go through the public API: ``KVStore.put`` of prompts of ``--batch`` chunks then
``flush`` (the remote writes are background group commits), and ``KVStore.get`` of them on a
second store (another "node": its host memory holds half of them, so every pass reads each
from the store). Best of ``--repeats``; the figure that counts is the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvtier.bench.remote_store import store_bandwidth  # noqa: E402
from kvtier.keys import ChunkKey, Namespace  # noqa: E402
from kvtier.remote.redis_tier import RedisTier  # noqa: E402
from kvtier.units import format_size, parse_size  # noqa: E402
from tests.helpers.redis_server import RedisServer  # noqa: E402

NS = Namespace(model="bench", kv_dtype="bfloat16", layout="bench", block_tokens=16, chunk_tokens=256)


def best(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(url: str, chunk: int, total: int, batch: int, repeats: int) -> dict:
    count = max(batch, total // chunk // batch * batch)
    data = [np.random.default_rng(i).integers(0, 256, chunk, dtype=np.uint8) for i in range(batch)]
    keys = [ChunkKey(i.to_bytes(16, "big")) for i in range(count)]
    dsts = [np.empty(chunk, np.uint8) for _ in range(batch)]
    tier = RedisTier(url, NS, chunk, timeout_s=30)
    raw = redis.Redis.from_url(url, socket_timeout=30)
    raw_values = [d.tobytes() for d in data]

    def tier_put():
        for at in range(0, count, batch):
            assert all(r.ok for r in tier.put_many(list(zip(keys[at:at + batch], data, strict=True))))

    def tier_get():
        for at in range(0, count, batch):
            assert all(r.ok for r in tier.get_many(keys[at:at + batch], dsts))

    def raw_put():
        for at in range(0, count, batch):
            pipe = raw.pipeline(transaction=False)
            for i, value in enumerate(raw_values):
                pipe.set(f"raw:{at + i}", value)
            pipe.execute()

    def raw_get():
        for at in range(0, count, batch):
            pipe = raw.pipeline(transaction=False)
            for i in range(batch):
                pipe.get(f"raw:{at + i}")
            assert all(v is not None for v in pipe.execute())

    moved = count * chunk
    row: dict[str, float] = {"chunk": chunk, "chunks": count, "batch": batch}
    for name, run in (("raw_put", raw_put), ("tier_put", tier_put), ("raw_get", raw_get),
                      ("tier_get", tier_get)):
        row[name] = moved / best(repeats, run) / 2**30
    row["store_put"], row["store_get"] = store_bandwidth(url, chunk, count, batch, repeats)
    for i in range(batch):  # every byte checked once
        assert np.array_equal(dsts[i], data[(count - batch + i) % batch])
    row["put_ratio"], row["get_ratio"] = row["tier_put"] / row["raw_put"], row["tier_get"] / row["raw_get"]
    row["store_put_ratio"] = row["store_put"] / row["raw_put"]
    row["store_get_ratio"] = row["store_get"] / row["raw_get"]
    raw.flushdb()
    tier.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a Redis server to use (default: start one on loopback)")
    parser.add_argument("--chunks", default="2MiB,8MiB,32MiB")
    parser.add_argument("--size", default="512MiB", help="bytes per pass and chunk size")
    parser.add_argument("--batch", type=int, default=8, help="chunks per round trip")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-redis-") as tmp:
        server = None if args.url else RedisServer(Path(tmp), "--maxmemory", "6gb").start()
        url = args.url or (server.url if server else "")
        try:
            rows = [measure(url, parse_size(c), parse_size(args.size), args.batch, args.repeats)
                    for c in args.chunks.split(",")]
        finally:
            if server is not None:
                server.stop()
    table = Table(title=f"RedisTier against redis-py, {args.size} a pass, {args.batch} chunks a "
                        f"round trip, best of {args.repeats} (same run, same server)")
    for column in ("chunk", "raw SET GiB/s", "tier put", "put/raw", "store put/raw",
                   "raw GET GiB/s", "tier get", "get/raw", "store get/raw"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(format_size(r["chunk"]), f"{r['raw_put']:.2f}", f"{r['tier_put']:.2f}",
                      f"{r['put_ratio']:.2f}", f"{r['store_put_ratio']:.2f}",
                      f"{r['raw_get']:.2f}", f"{r['tier_get']:.2f}", f"{r['get_ratio']:.2f}",
                      f"{r['store_get_ratio']:.2f}")
    Console().print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
