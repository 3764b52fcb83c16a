"""Two checkouts of kvtier side by side through ``KVStore``'s public API: put + flush, then
get after a restart (page cache dropped), passes interleaved (the trees' order reversed
every other pass), the median and best of N each.

    git worktree add /tmp/kvtier-before <commit>
    .venv/bin/python scripts/ab_store.py --tree /tmp/kvtier-before --tree . \\
        --dir /mnt/kvtier-ram/ab --chunk-mib 1,2,32 --total-gib 1 --passes 3
    .venv/bin/python scripts/ab_store.py --tree /tmp/kvtier-before --tree . \\
        --dir /mnt/kvtier-ram/ab --small --passes 5

Each pass runs in a fresh process that imports kvtier from its tree. The layout is
Llama-3-8B's (32 layers, 8 KV heads, 128 dims, bf16: 128 KiB a token), 512 MiB of host
memory, so most chunks of a pass come back from disk; every byte read is checked.

``--small``: the cost of an operation rather than of a byte. The soak's store (32 KiB
chunks, 24 in host memory, 200 on disk, write-through; ``scripts/soak.py``) under one thread
putting and getting prefixes of 1 to 8 chunks at random for 8 s, no fault injected:
operations a second and this process's CPU per operation (every thread's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import json, os, sys, time, torch
sys.path.insert(0, sys.argv[1])
from kvtier import KVStore, KVLayout
root, chunk_mib, total_gib = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
layout = KVLayout(num_layers=32, kv_heads=8, head_size=128, dtype="bfloat16")
chunk_tokens = chunk_mib * 2**20 // layout.token_bytes
tokens = int(total_gib * 2**30) // layout.token_bytes // chunk_tokens * chunk_tokens
cfg = {"chunk_tokens": chunk_tokens, "host_capacity": "512MiB", "disk_paths": [root],
       "disk_capacity": f"{int(total_gib * 1.3 * 1024)}MiB", "disk_min_free": 0}
kv = torch.randn(layout.shape(tokens)).to(torch.bfloat16)
ids = list(range(tokens))
with KVStore(layout, cfg, model="ab") as store:
    start = time.perf_counter()
    store.put(ids, kv)
    flushed = store.flush()
    put_s = time.perf_counter() - start
    assert flushed, flushed
with open("/proc/sys/vm/drop_caches", "w") as f:
    os.sync(); f.write("3")
out = torch.empty_like(kv)
with KVStore(layout, cfg, model="ab") as store:
    start = time.perf_counter()
    got = store.get(ids, out)
    get_s = time.perf_counter() - start
assert got == tokens and torch.equal(out.view(torch.int16), kv.view(torch.int16)), "wrong bytes"
gib = tokens * layout.token_bytes / 2**30
print(json.dumps({"put_flush_gib_s": gib / put_s, "get_gib_s": gib / get_s}))
'''

SMALL = r'''
import json, random, sys, time, torch
sys.path.insert(0, sys.argv[1])
from kvtier import KVStore, KVLayout
root, chunk = sys.argv[2], 32
layout = KVLayout(num_layers=2, kv_heads=2, head_size=64, dtype="bfloat16")
chunk_bytes = layout.token_bytes * chunk
cfg = {"chunk_tokens": chunk, "host_capacity": 24 * chunk_bytes, "disk_paths": [root],
       "disk_capacity": 200 * (4096 + chunk_bytes), "disk_min_free": 0, "io_threads": 4}
rng = random.Random(1)
prefixes = [[rng.randrange(50000) for _ in range(chunk * rng.randrange(1, 9))] for _ in range(300)]
kv = torch.randn(layout.shape(8 * chunk)).to(torch.bfloat16)
out = torch.zeros_like(kv)
with KVStore(layout, cfg, model="ab") as store:
    ops, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < 8:
        tokens = prefixes[rng.randrange(len(prefixes))]
        if rng.random() < 0.5:
            store.put(tokens, kv[:, :, :len(tokens)])
        else:
            got = store.get(tokens, out)
            assert torch.equal(out[:, :, :got].view(torch.int16),
                               kv[:, :, :got].view(torch.int16)), "wrong bytes"
        ops += 1
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"ops_per_s": ops / seconds, "cpu_us_per_op": cpu / ops * 1e6}))
'''


def one_pass(tree: str, root: Path, chunk_mib: int | None, total_gib: float) -> dict[str, float]:
    """One pass of ``tree``: the large-chunk figures, or with no ``chunk_mib`` the small ones."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    argv = [CHILD, tree, str(root), str(chunk_mib), str(total_gib)] if chunk_mib else [SMALL, tree, str(root)]
    done = subprocess.run([sys.executable, "-c", *argv], capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"{tree}: pass failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="a kvtier checkout")
    parser.add_argument("--dir", type=Path, required=True, help="scratch directory (erased)")
    parser.add_argument("--chunk-mib", default="1,2,32")
    parser.add_argument("--total-gib", type=float, default=1.0)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--small", action="store_true",
                        help="operations on small chunks instead of bandwidth (--chunk-mib unused)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    trees = [os.path.abspath(t) for t in args.tree]
    rows = []
    try:
        sizes: list[int | None] = [None] if args.small else [int(c) for c in args.chunk_mib.split(",")]
        for chunk in sizes:
            passes: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
            for i in range(args.passes):
                for tree in trees if i % 2 == 0 else trees[::-1]:
                    for name, value in one_pass(tree, args.dir, chunk, args.total_gib).items():
                        passes[tree].setdefault(name, []).append(value)
            median = {t: {n: statistics.median(v) for n, v in m.items()} for t, m in passes.items()}
            best = {t: {n: min(v) if n.startswith("cpu") else max(v) for n, v in m.items()}
                    for t, m in passes.items()}  # CPU per operation: the least is the best
            rows.append({"chunk_mib": chunk, "median": median, "best": best, "passes": passes})
            for label, figures in (("median", median), ("best", best)):
                first = figures[trees[0]]
                print(f"{f'{chunk} MiB' if chunk else 'small'} chunks, {label}: " + "; ".join(
                    f"{Path(t).name}: " + ", ".join(f"{name} {value:.2f} ({value / first[name]:.2f}x)"
                                                   for name, value in b.items())
                    for t, b in figures.items()))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
