"""Pages of one run per head (KV cache layouts LHBNC, BHLNC): one strided copy per run of
blocks, as ``PagedKV`` does, against a copy head by head, on the CPU.

    .venv/bin/python scripts/bench_page_runs.py [--heads 8] [--run-kib 8] [--blocks 16]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--run-kib", type=int, default=8, help="bytes of one head's run in a page")
    parser.add_argument("--blocks", type=int, default=16, help="blocks copied together")
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    heads, run, count, cache_blocks = args.heads, args.run_kib << 10, args.blocks, 1024
    raw = np.random.randint(0, 255, size=(heads, cache_blocks, run), dtype=np.uint8)  # faulted in
    pages = raw.transpose(1, 0, 2)  # (blocks, heads, run): the heads outside the block
    rows = np.random.randint(0, 255, size=(count, heads, run), dtype=np.uint8)

    def strided(block: int) -> None:
        np.copyto(pages[block:block + count], rows)

    def per_head(block: int) -> None:
        for h in range(heads):
            np.copyto(pages[block:block + count, h], rows[:, h])

    for copy in (strided, per_head, strided, per_head):
        start = time.perf_counter()
        for r in range(args.rounds):
            copy(r * count % (cache_blocks - count))
        seconds = time.perf_counter() - start
        print(f"{copy.__name__:9s} {args.rounds * rows.nbytes / seconds / 2**30:.1f} GiB/s")


if __name__ == "__main__":
    main()
