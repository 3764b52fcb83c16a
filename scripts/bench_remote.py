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
import torch  # noqa: E402

from kvtier import KVStore  # noqa: E402
from kvtier.keys import ChunkKey, Namespace  # noqa: E402
from kvtier.layout import KVLayout  # noqa: E402
from kvtier.remote.redis_tier import RedisTier  # noqa: E402
from kvtier.units import format_size, parse_size  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

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
    row = {"chunk": chunk, "chunks": count, "batch": batch}
    for name, run in (("raw_put", raw_put), ("tier_put", tier_put), ("raw_get", raw_get),
                      ("tier_get", tier_get)):
        row[name] = moved / best(repeats, run) / 2**30
    row["store_put"], row["store_get"] = measure_store(url, chunk, count, batch, repeats)
    for i in range(batch):  # every byte checked once
        assert np.array_equal(dsts[i], data[(count - batch + i) % batch])
    row["put_ratio"], row["get_ratio"] = row["tier_put"] / row["raw_put"], row["tier_get"] / row["raw_get"]
    row["store_put_ratio"] = row["store_put"] / row["raw_put"]
    row["store_get_ratio"] = row["store_get"] / row["raw_get"]
    raw.flushdb()
    tier.close()
    return row


LAYOUT = KVLayout(num_layers=2, kv_heads=8, head_size=128, dtype="bfloat16")  # 8 KiB a token


def measure_store(url: str, chunk: int, count: int, batch: int, repeats: int) -> tuple[float, float]:
    """GiB/s of ``KVStore.put`` + ``flush`` to the store, and of ``KVStore.get`` from it on
    a second store, prompts of ``batch`` chunks."""
    tokens = chunk // LAYOUT.token_bytes
    prompts = [list(range(p * 10**6, p * 10**6 + batch * tokens)) for p in range(count // batch)]
    kv = torch.from_numpy(np.random.default_rng(0).integers(-2**15, 2**15, (
        LAYOUT.num_layers, 2, batch * tokens, LAYOUT.hidden), dtype=np.int16)).view(torch.bfloat16)
    config = {"chunk_tokens": tokens, "remote_url": url, "remote_timeout": "30s", "io_threads": 8}
    host = f"{count * chunk // 2**20 + 64}MiB"
    put_s, get_s = [], []
    for r in range(repeats):
        with KVStore(LAYOUT, {**config, "host_capacity": host}, model=f"bench-{r}") as writer:
            start = time.perf_counter()
            for prompt in prompts:
                writer.put(prompt, kv)
            assert writer.flush(600) and writer.stats().remote_writes == count
            put_s.append(time.perf_counter() - start)
        half = f"{count * chunk // 2 // 2**20 + 1}MiB"
        with KVStore(LAYOUT, {**config, "host_capacity": half}, model=f"bench-{r}") as reader:
            out = reader.empty_kv(batch * tokens)
            start = time.perf_counter()
            for prompt in prompts:
                assert reader.get(prompt, out) == len(prompt)
            get_s.append(time.perf_counter() - start)
            assert reader.stats().remote_reads == count
            assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
    moved = count * chunk / 2**30
    return moved / min(put_s), moved / min(get_s)


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
        url = args.url or server.url
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
