"""Scheduler steps, and a store's calls, held by a disk path back with N chunks (200,000).

    python scripts/bench_path_back.py [--chunks 200000] [--json out/bench_path_back.json]

The vLLM connector's scheduler side, its second disk path out since the start, gets the
worker report that brings the path back with N chunks found on it, then plans steps
(``build_meta``, as vLLM's scheduler does once a step) until every chunk is adopted; the
first step is timed with the report before it (both fall between the same two forward
passes). Timed twice in one run, side by side: every chunk adopted at the first step
(``ADOPT_PER_STEP`` = N), and kvtier's ``ADOPT_PER_STEP`` a step. No file is written:
the chunks are named in the report.

Then a standalone ``KVStore`` on two paths, its second out since the start: the path comes
back with N chunks found on it (named as a read-back reports them, no file written), as its
read-back's thread brings it back (``on_back`` with the store's lock held, then the rest of
the adoption a share a lock hold), while another thread calls ``lookup`` again and again;
the longest call, and the time until every chunk is adopted. Side by side: every chunk
adopted in one hold (``ADOPT_PER_HOLD`` = N), and kvtier's ``ADOPT_PER_HOLD`` a hold.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from kvtier import KVStore
from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import WorkerReport
from kvtier.connector.scheduler import paths_back
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.disk.recovery import RecoveredSlot
from kvtier.disk.retry import SHARE_PAUSE_S
from kvtier.io.format import Codec, SlotHeader
from kvtier.layout import KVLayout
from kvtier.store import adoption
from kvtier.tiers.base import TierName

GEO = KVGeometry(num_layers=2, page_bytes=4096, block_tokens=16, hash_block_tokens=16,
                 chunk_tokens=32, kv_dtype="bfloat16", page_shape="t")


def steps_held(chunks: int, per_step: int) -> dict:
    """The step that brings the path back, and the later ones until all are adopted (s)."""
    paths_back.ADOPT_PER_STEP = per_step
    with tempfile.TemporaryDirectory(prefix="kvtier-path-back-") as work:
        roots = [os.path.join(work, "a"), os.path.join(work, "b")]
        for root in roots:
            os.mkdir(root)
        cfg = load_config({"chunk_tokens": 32, "host_capacity": 4 * GEO.chunk_bytes,
                           "disk_paths": roots, "disk_capacity": 2 * chunks * (4096 + GEO.chunk_bytes),
                           "share_refresh": "off"}, environ={})
        side = SchedulerSide(cfg, GEO, [GEO.namespace("m", "", 1, 0)], 1)
        disk = side.stack.indexes[TierName.DISK]
        side.worker_report(WorkerReport(paths_down=Counter({1: 1})))
        found = {(1, 2 * i + 1, os.urandom(16)): (1, i) for i in range(chunks)}
        began = time.perf_counter()
        side.worker_report(WorkerReport(paths_up=Counter({1: 1}), paths_found=found))
        side.build_meta()
        back, later = time.perf_counter() - began, []
        while side.has_pending_push_work():  # (vLLM steps an idle engine meanwhile)
            began = time.perf_counter()
            side.build_meta()
            later.append(time.perf_counter() - began)
        assert len(disk) == chunks, f"{len(disk)} of {chunks} chunks adopted"
        side.close()
    return {"per_step": per_step, "back_s": back, "later_steps": len(later),
            "later_max_s": max(later, default=0.0),
            "later_mean_s": sum(later) / len(later) if later else 0.0}


def store_calls_held(chunks: int, per_hold: int) -> dict:
    """The longest ``lookup`` while a path back's chunks are adopted, and the adoption's time."""
    adoption.ADOPT_PER_HOLD = per_hold
    layout = KVLayout(num_layers=2, kv_heads=2, head_size=16, dtype="bfloat16")
    with tempfile.TemporaryDirectory(prefix="kvtier-path-back-") as work:
        roots = [os.path.join(work, "a"), os.path.join(work, "b")]
        os.mkdir(roots[0])  # the second is missing at start
        stride = 4096 + layout.token_bytes * 16
        cfg = {"chunk_tokens": 16, "host_capacity": 64 * layout.token_bytes * 16,
               "disk_paths": roots, "disk_capacity": 2 * chunks * stride, "disk_min_free": 0,
               "disk_retry": "off", "model": "bench"}
        with KVStore(layout, cfg) as store:
            books = store._books  # white-box: the lock and the call a read-back makes
            found = [RecoveredSlot(2 * i + 1, SlotHeader(b"n" * 16, os.urandom(16), Codec.NONE,
                                                         0, 0, 0, i, 0)) for i in range(chunks)]
            found.reverse()  # newest first, as a read-back's thread sorts them off the lock
            with books.held() as held:  # the path taken out, as at start
                held.stack.indexes[TierName.DISK].retire(range(1, 2 * chunks, 2))
            calls: list[float] = []
            stop = threading.Event()

            def look() -> None:
                tokens = list(range(16 * 4))
                while not stop.is_set():
                    began = time.perf_counter()
                    store.lookup(tokens)
                    calls.append(time.perf_counter() - began)
                    time.sleep(0.001)

            thread = threading.Thread(target=look)
            thread.start()
            time.sleep(0.05)
            began = time.perf_counter()
            with books.held():  # the read-back's thread: on_back with the lock held
                more = books.path_back(1, found)
            while more is not None and more():  # then a share a hold, as DiskRetries does
                time.sleep(SHARE_PAUSE_S)
            took = time.perf_counter() - began
            time.sleep(0.05)
            stop.set()
            thread.join()
            assert store.stats().recovered_chunks == chunks
    return {"per_hold": per_hold, "adopted_s": took, "lookups": len(calls),
            "lookup_max_s": max(calls), "lookup_mean_s": sum(calls) / len(calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=200_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    batched, per_hold = paths_back.ADOPT_PER_STEP, adoption.ADOPT_PER_HOLD
    rows = [steps_held(args.chunks, args.chunks), steps_held(args.chunks, batched)]
    for row in rows:
        print(f"ADOPT_PER_STEP {row['per_step']:>7}: the step back {row['back_s'] * 1e3:7.0f} ms, "
              f"then {row['later_steps']} steps, at most {row['later_max_s'] * 1e3:.0f} ms "
              f"(mean {row['later_mean_s'] * 1e3:.0f} ms)")
    print(f"the step back held {rows[1]['back_s'] / rows[0]['back_s']:.2f}x as long as adopting all at once")
    store = [store_calls_held(args.chunks, args.chunks),
             store_calls_held(args.chunks, per_hold)]
    for row in store:
        print(f"KVStore, ADOPT_PER_HOLD {row['per_hold']:>7}: adopted in {row['adopted_s']:.2f} s; "
              f"{row['lookups']} lookups meanwhile, the longest {row['lookup_max_s'] * 1e3:.0f} ms "
              f"(mean {row['lookup_mean_s'] * 1e3:.1f} ms)")
    print(f"the longest lookup took {store[1]['lookup_max_s'] / store[0]['lookup_max_s']:.2f}x "
          "as long as while adopting all in one hold")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"chunks": args.chunks, "rows": rows, "store": store},
                                        indent=2))


if __name__ == "__main__":
    main()
