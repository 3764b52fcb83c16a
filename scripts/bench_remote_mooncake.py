"""The remote tier's Mooncake backend against the raw Mooncake client, on one store, in one run.

    python scripts/bench_remote_mooncake.py                  # as root: its own store, in a netns
    python scripts/bench_remote_mooncake.py --chunks 2MiB,32MiB --json out/mooncake.json

It re-runs itself in a private network namespace holding only loopback (``unshare -n``:
Mooncake's listeners bind every interface), starts a mooncake_master and a holder process
that lends the pool ``--segment`` bytes, so every byte crosses TCP loopback between
processes. For each chunk size: ``--size`` bytes of chunks put with ``MooncakeTier.put_many``
and read back with ``get_many`` (a header with each, every value checked down to its
checksum), ``--batch`` chunks a round trip, from and into a registered host buffer (no
copy), and again from and into plain buffers (staged through the tier's scratch); against
the raw client's ``batch_put_from`` / ``batch_get_into`` of registered buffers (nothing
framed, nothing checked). Values are removed between passes; best of ``--repeats``; the
figures that count are the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvtier.keys import ChunkKey, Namespace  # noqa: E402
from kvtier.remote.mooncake_tier import MooncakeTier  # noqa: E402
from kvtier.remote.values import value_key  # noqa: E402
from kvtier.units import format_size, parse_size  # noqa: E402
from tests.mooncake_server import NETNS_ENV, MooncakeServer, inside_namespace, skip_reason  # noqa: E402

NS = Namespace(model="bench", kv_dtype="bfloat16", layout="bench", block_tokens=16, chunk_tokens=256)
PREFIX = "bench:"


def timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


class Case:
    """The chunks of one size, the buffers they move between, and the passes timed."""

    def __init__(self, server: MooncakeServer, chunk: int, total: int, batch: int) -> None:
        self.chunk, self.batch = chunk, batch
        self.count = max(batch, total // chunk // batch * batch)
        self.keys = [ChunkKey(i.to_bytes(16, "big")) for i in range(self.count)]
        self.names = [value_key(PREFIX, NS.digest(), k).decode() for k in self.keys]
        self.host = np.random.default_rng(chunk).integers(0, 256, 2 * batch * chunk, dtype=np.uint8)
        self.plain = [self.host[i * chunk:(i + 1) * chunk].copy() for i in range(2 * batch)]
        self.raw = server.client()
        assert self.raw.register_buffer(self.host.ctypes.data, self.host.nbytes) == 0
        self.tier = MooncakeTier(server.url, NS, chunk, timeout_s=30, prefix=PREFIX)
        self.tier.register(self.host)
        self.plain_tier = MooncakeTier(server.url, NS, chunk, timeout_s=30, prefix=PREFIX)

    def slot(self, i: int) -> np.ndarray:
        return self.host[i * self.chunk:(i + 1) * self.chunk]

    def batches(self) -> range:
        return range(0, self.count, self.batch)

    def raw_put(self) -> None:
        for at in self.batches():
            codes = self.raw.batch_put_from([f"raw:{at + i}" for i in range(self.batch)],
                                            [self.slot(i).ctypes.data for i in range(self.batch)],
                                            [self.chunk] * self.batch)
            assert all(c == 0 for c in codes), codes

    def raw_get(self) -> None:
        for at in self.batches():
            dsts = [self.slot(self.batch + i).ctypes.data for i in range(self.batch)]
            codes = self.raw.batch_get_into([f"raw:{at + i}" for i in range(self.batch)], dsts,
                                            [self.chunk] * self.batch)
            assert all(c == self.chunk for c in codes), codes

    def tier_put(self, tier: MooncakeTier, bufs: list[np.ndarray]) -> None:
        for at in self.batches():
            results = tier.put_many(list(zip(self.keys[at:at + self.batch], bufs[: self.batch], strict=True)))
            assert all(r.ok for r in results), results[:2]

    def tier_get(self, tier: MooncakeTier, bufs: list[np.ndarray]) -> None:
        for at in self.batches():
            results = tier.get_many(self.keys[at:at + self.batch], bufs[self.batch:])
            assert all(r.ok for r in results), results[:2]

    def clean(self) -> None:
        names = self.names + [f"raw:{i}" for i in range(self.count)]
        for at in range(0, len(names), 256):
            self.raw.batch_remove(names[at:at + 256], True)

    def measure(self, repeats: int) -> dict[str, Any]:
        slots = [self.slot(i) for i in range(2 * self.batch)]
        passes: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
            "raw": (self.raw_put, self.raw_get),
            "tier": (lambda: self.tier_put(self.tier, slots), lambda: self.tier_get(self.tier, slots)),
            "staged": (lambda: self.tier_put(self.plain_tier, self.plain),
                       lambda: self.tier_get(self.plain_tier, self.plain)),
        }
        times: dict[str, list[float]] = {f"{n}_{op}": [] for n in passes for op in ("put", "get")}
        self.raw_put()  # the holder's pages touched once, before any pass is timed
        self.clean()
        for _ in range(repeats):  # the three interleaved, each on an empty store
            for name, (put, get) in passes.items():
                times[f"{name}_put"].append(timed(put))
                times[f"{name}_get"].append(timed(get))
                self.clean()
        moved = self.count * self.chunk / 2**30
        row: dict[str, Any] = {"chunk": self.chunk, "chunks": self.count, "batch": self.batch}
        row.update({name: moved / min(seconds) for name, seconds in times.items()})
        for i in range(self.batch):  # the last reads, checked byte for byte
            assert np.array_equal(self.plain[self.batch + i], self.plain[i])
            assert np.array_equal(slots[self.batch + i], slots[i])
        for name in ("tier", "staged"):
            row[f"{name}_put_ratio"] = row[f"{name}_put"] / row["raw_put"]
            row[f"{name}_get_ratio"] = row[f"{name}_get"] / row["raw_get"]
        self.tier.close()
        self.plain_tier.close()
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="2MiB,8MiB,32MiB")
    parser.add_argument("--size", default="512MiB", help="bytes per pass and chunk size")
    parser.add_argument("--batch", type=int, default=8, help="chunks per round trip")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--segment", default="2GiB", help="memory the holder lends the pool")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not inside_namespace():
        reason = skip_reason()
        if reason:
            sys.exit(reason)
        os.execvpe("unshare", ["unshare", "-n", "--", "bash", "-c", 'ip link set lo up && exec "$@"',
                               "bash", sys.executable, __file__, *sys.argv[1:]],
                   {**os.environ, NETNS_ENV: "1"})
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory(prefix="kvtier-mooncake-") as tmp:
        server = MooncakeServer(Path(tmp), parse_size(args.segment)).start()
        try:
            rows = [Case(server, parse_size(c), parse_size(args.size), args.batch).measure(args.repeats)
                    for c in args.chunks.split(",")]
        finally:
            server.stop()
    table = Table(title=f"MooncakeTier against the raw Mooncake client, {args.size} a pass, "
                        f"{args.batch} chunks a round trip, best of {args.repeats} (same run, same "
                        "store, TCP loopback to a holder process)")
    for column in ("chunk", "raw put GiB/s", "tier put", "put/raw", "staged put/raw",
                   "raw get GiB/s", "tier get", "get/raw", "staged get/raw"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(format_size(r["chunk"]), f"{r['raw_put']:.2f}", f"{r['tier_put']:.2f}",
                      f"{r['tier_put_ratio']:.2f}", f"{r['staged_put_ratio']:.2f}",
                      f"{r['raw_get']:.2f}", f"{r['tier_get']:.2f}", f"{r['tier_get_ratio']:.2f}",
                      f"{r['staged_get_ratio']:.2f}")
    Console(width=150).print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
