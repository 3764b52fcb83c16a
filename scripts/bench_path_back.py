"""Scheduler steps held by a disk path back with N chunks (default 200,000) in vLLM.

    python scripts/bench_path_back.py [--chunks 200000] [--json out/bench_path_back.json]

The vLLM connector's scheduler side, its second disk path out since the start, gets the
worker report that brings the path back with N chunks found on it, then plans steps
(``build_meta``, as vLLM's scheduler does once a step) until every chunk is adopted; the
first step is timed with the report before it (both fall between the same two forward
passes). Timed twice in one run, side by side: every chunk adopted at the first step
(``ADOPT_PER_STEP`` = N), and kvtier's ``ADOPT_PER_STEP`` a step. No file is written:
the chunks are named in the report.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import WorkerReport
from kvtier.connector.scheduler import paths_back
from kvtier.connector.scheduler.side import SchedulerSide
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=200_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    batched = paths_back.ADOPT_PER_STEP
    rows = [steps_held(args.chunks, args.chunks), steps_held(args.chunks, batched)]
    for row in rows:
        print(f"ADOPT_PER_STEP {row['per_step']:>7}: the step back {row['back_s'] * 1e3:7.0f} ms, "
              f"then {row['later_steps']} steps, at most {row['later_max_s'] * 1e3:.0f} ms "
              f"(mean {row['later_mean_s'] * 1e3:.0f} ms)")
    print(f"the step back held {rows[1]['back_s'] / rows[0]['back_s']:.2f}x as long as adopting all at once")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"chunks": args.chunks, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
