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
framed, nothing checked), and that raw get followed by the checksum of every value it read
("checked raw": what verifying costs on its own). Two more put arms take a tier's put apart:
the raw client's ``batch_put_from_multi_buffers`` of each value as the tier moves it, a
header-sized piece then the payload ("two pieces", nothing checked), and that put preceded
by the checksum of every payload ("checked two pieces": the tier's work less its Python).
One more get arm does the same for reads: the raw client's ``batch_get_into_multi_buffers``
of each two-piece value into a header-sized piece and the payload's buffer ("two-piece
get", nothing checked), as the tier reads.
The arms take turns batch by batch, in a rotating order, so that they share the machine's
moods; values are removed between rounds; best of ``--repeats`` rounds (and the median of
the rounds' ratios). Then the public API: ``KVStore.put`` + ``flush`` to the store and
``KVStore.get`` on a second store (``kvtier.bench.remote_store``). The figures that count
are the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvtier.bench.remote_store import store_bandwidth  # noqa: E402
from kvtier.io.format import payload_checksum  # noqa: E402
from kvtier.keys import ChunkKey, Namespace  # noqa: E402
from kvtier.remote.mooncake_tier import MooncakeTier  # noqa: E402
from kvtier.remote.values import ValueFormat, value_key  # noqa: E402
from kvtier.units import format_size, parse_size  # noqa: E402
from tests.helpers.mooncake_server import NETNS_ENV, MooncakeServer, inside_namespace, skip_reason  # noqa: E402

NS = Namespace(model="bench", kv_dtype="bfloat16", layout="bench", block_tokens=16, chunk_tokens=256)
PREFIX, STAGED_PREFIX = "bench:", "bench-staged:"


def timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


class Case:
    """The chunks of one size, the buffers they move between, and the batches timed."""

    def __init__(self, server: MooncakeServer, chunk: int, total: int, batch: int) -> None:
        self.chunk, self.batch, self.url = chunk, batch, server.url
        self.count = max(batch, total // chunk // batch * batch)
        self.keys = [ChunkKey(i.to_bytes(16, "big")) for i in range(self.count)]
        self.host = np.random.default_rng(chunk).integers(0, 256, 2 * batch * chunk, dtype=np.uint8)
        self.plain = [self.host[i * chunk:(i + 1) * chunk].copy() for i in range(2 * batch)]
        self.raw = server.client()
        assert self.raw.register_buffer(self.host.ctypes.data, self.host.nbytes) == 0
        self.tier = MooncakeTier(server.url, NS, chunk, timeout_s=30, prefix=PREFIX)
        self.tier.register(self.host)
        self.plain_tier = MooncakeTier(server.url, NS, chunk, timeout_s=30, prefix=STAGED_PREFIX)
        self.slots = [self.slot(i) for i in range(2 * batch)]
        self.header_bytes = ValueFormat(NS.digest(), chunk).header_bytes  # before each payload
        self.headers = np.zeros(batch * self.header_bytes, dtype=np.uint8)  # zeros: not read
        assert self.raw.register_buffer(self.headers.ctypes.data, self.headers.nbytes) == 0

    def slot(self, i: int) -> np.ndarray:
        return self.host[i * self.chunk:(i + 1) * self.chunk]

    def raw_put(self, at: int) -> None:
        codes = self.raw.batch_put_from([f"raw:{at + i}" for i in range(self.batch)],
                                        [self.slot(i).ctypes.data for i in range(self.batch)],
                                        [self.chunk] * self.batch)
        assert all(c == 0 for c in codes), codes

    def pieces_put(self, at: int, check: bool = False) -> None:
        """The raw client moving each value as the tier does: a header's bytes, then the
        payload from its registered slot; with ``check``, each payload's checksum first."""
        if check:
            for i in range(self.batch):
                payload_checksum(self.slot(i).data)
        hb, tag = self.header_bytes, "pieces-checked" if check else "pieces"
        codes = self.raw.batch_put_from_multi_buffers(
            [f"{tag}:{at + i}" for i in range(self.batch)],
            [[self.headers.ctypes.data + i * hb, self.slot(i).ctypes.data] for i in range(self.batch)],
            [[hb, self.chunk]] * self.batch)
        assert all(c == 0 for c in codes), codes

    def raw_get(self, at: int, check: bool = False) -> None:
        dsts = [self.slot(self.batch + i).ctypes.data for i in range(self.batch)]
        codes = self.raw.batch_get_into([f"raw:{at + i}" for i in range(self.batch)], dsts,
                                        [self.chunk] * self.batch)
        assert all(c == self.chunk for c in codes), codes
        if check:  # what verifying costs on its own: each value's payload checksum
            for i in range(self.batch):
                payload_checksum(self.slot(self.batch + i).data)

    def pieces_get(self, at: int) -> None:
        """The raw client reading the values ``pieces_put`` wrote as the tier reads: a
        header's bytes, then the payload into its registered slot; nothing checked."""
        hb = self.header_bytes
        codes = self.raw.batch_get_into_multi_buffers(
            [f"pieces:{at + i}" for i in range(self.batch)],
            [[self.headers.ctypes.data + i * hb, self.slot(self.batch + i).ctypes.data]
             for i in range(self.batch)],
            [[hb, self.chunk]] * self.batch)
        assert all(c == hb + self.chunk for c in codes), codes

    def tier_put(self, tier: MooncakeTier, bufs: list[np.ndarray], at: int) -> None:
        results = tier.put_many(list(zip(self.keys[at:at + self.batch], bufs[: self.batch], strict=True)))
        assert all(r.ok for r in results), results[:2]

    def tier_get(self, tier: MooncakeTier, bufs: list[np.ndarray], at: int) -> None:
        results = tier.get_many(self.keys[at:at + self.batch], bufs[self.batch:])
        assert all(r.ok for r in results), results[:2]

    def clean(self) -> None:
        names = [f"{tag}:{i}" for tag in ("raw", "pieces", "pieces-checked")
                 for i in range(self.count)] + [
            value_key(prefix, NS.digest(), k).decode() for prefix in (PREFIX, STAGED_PREFIX)
            for k in self.keys]
        for at in range(0, len(names), 256):
            self.raw.batch_remove(names[at:at + 256], True)

    def measure(self, repeats: int, store_repeats: int) -> dict[str, Any]:
        """Each round: every batch put by each arm in turn, then read back by each arm in
        turn (the order rotating batch by batch), so that the arms share the machine's
        moods; then the store emptied."""
        puts: dict[str, Callable[[int], None]] = {
            "raw": self.raw_put,
            "pieces": self.pieces_put,
            "checked_pieces": lambda at: self.pieces_put(at, check=True),
            "tier": lambda at: self.tier_put(self.tier, self.slots, at),
            "staged": lambda at: self.tier_put(self.plain_tier, self.plain, at)}
        gets: dict[str, Callable[[int], None]] = {
            "raw": self.raw_get,
            "checked": lambda at: self.raw_get(at, check=True),
            "pieces": self.pieces_get,
            "tier": lambda at: self.tier_get(self.tier, self.slots, at),
            "staged": lambda at: self.tier_get(self.plain_tier, self.plain, at)}
        times: dict[str, list[float]] = {f"{name}_{op}": [] for op, arms in (("put", puts), ("get", gets))
                                         for name in arms}
        for at in range(0, self.count, self.batch):  # the holder's pages touched once, untimed
            self.raw_put(at)
        self.clean()
        for _ in range(repeats):
            for op, arms in (("put", puts), ("get", gets)):
                spent = dict.fromkeys(arms, 0.0)
                names = list(arms)
                for turn, at in enumerate(range(0, self.count, self.batch)):
                    for name in names[turn % len(names):] + names[: turn % len(names)]:
                        spent[name] += timed(lambda: arms[name](at))  # noqa: B023
                for name, seconds in spent.items():
                    times[f"{name}_{op}"].append(seconds)
            self.clean()
        moved = self.count * self.chunk / 2**30
        row: dict[str, Any] = {"chunk": self.chunk, "chunks": self.count, "batch": self.batch}
        row.update({name: moved / min(seconds) for name, seconds in times.items()})
        for i in range(self.batch):  # the last reads, checked byte for byte
            assert np.array_equal(self.plain[self.batch + i], self.plain[i])
            assert np.array_equal(self.slots[self.batch + i], self.slots[i])
        for name in ("tier", "staged"):
            for op in ("put", "get"):
                row[f"{name}_{op}_ratio"] = row[f"{name}_{op}"] / row[f"raw_{op}"]
                row[f"{name}_{op}_ratio_median"] = statistics.median(  # round by round
                    raw / mine for raw, mine in zip(times[f"raw_{op}"], times[f"{name}_{op}"], strict=True))
        for name in ("pieces", "checked_pieces"):
            row[f"{name}_put_ratio"] = row[f"{name}_put"] / row["raw_put"]
        row["tier_put_to_checked"] = row["tier_put"] / row["checked_pieces_put"]
        row["check_share"] = 1 - row["checked_get"] / row["raw_get"]  # of a raw get's time
        row["pieces_get_ratio"] = row["pieces_get"] / row["raw_get"]
        row["tier_get_to_checked"] = row["tier_get"] / row["checked_get"]
        self.tier.close()
        self.plain_tier.close()
        if store_repeats:
            row["store_put"], row["store_get"] = store_bandwidth(
                self.url, self.chunk, self.count, self.batch, store_repeats,
                clean=lambda: self.raw.remove_by_regex("^kvtier:", True))
            row["store_put_ratio"] = row["store_put"] / row["raw_put"]
            row["store_get_ratio"] = row["store_get"] / row["raw_get"]
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="2MiB,8MiB,32MiB")
    parser.add_argument("--size", default="512MiB", help="bytes per pass and chunk size")
    parser.add_argument("--batch", type=int, default=8, help="chunks per round trip")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--store-repeats", type=int, default=3,
                        help="rounds of the KVStore arm (0: none)")
    parser.add_argument("--segment", default="4GiB", help="memory the holder lends the pool "
                        "(a round's values of every put arm: 5 times --size)")
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
            rows = [Case(server, parse_size(c), parse_size(args.size), args.batch).measure(
                args.repeats, args.store_repeats) for c in args.chunks.split(",")]
        finally:
            server.stop()
    table = Table(title=f"MooncakeTier against the raw Mooncake client, {args.size} a pass, "
                        f"{args.batch} chunks a round trip, best of {args.repeats} (same run, same "
                        "store, TCP loopback to a holder process)")
    for column in ("chunk", "raw put GiB/s", "tier put", "put/raw (median)", "staged put/raw",
                   "two pieces/raw", "checked two pieces/raw", "put/checked two pieces",
                   "raw get GiB/s", "tier get", "get/raw (median)", "staged get/raw",
                   "two-piece get/raw",
                   "check share", "get/checked raw", "store put/raw", "store get/raw"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(format_size(r["chunk"]), f"{r['raw_put']:.2f}", f"{r['tier_put']:.2f}",
                      f"{r['tier_put_ratio']:.2f} ({r['tier_put_ratio_median']:.2f})",
                      f"{r['staged_put_ratio']:.2f}", f"{r['pieces_put_ratio']:.2f}",
                      f"{r['checked_pieces_put_ratio']:.2f}", f"{r['tier_put_to_checked']:.2f}",
                      f"{r['raw_get']:.2f}", f"{r['tier_get']:.2f}",
                      f"{r['tier_get_ratio']:.2f} ({r['tier_get_ratio_median']:.2f})",
                      f"{r['staged_get_ratio']:.2f}", f"{r['pieces_get_ratio']:.2f}",
                      f"{r['check_share']:.0%}",
                      f"{r['tier_get_to_checked']:.2f}", f"{r.get('store_put_ratio', 0):.2f}",
                      f"{r.get('store_get_ratio', 0):.2f}")
    Console(width=200).print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
