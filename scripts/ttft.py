"""Time to first token on long prompts: recompute, kvtier (host and disk hits), and vLLM's
ExampleConnector, each in its own engine process, all in one run.

    python scripts/ttft.py                       # tiny model, 1k/2k/4k tokens (a minute or two)
    python scripts/ttft.py --model mid --lengths 1024,4096,8192 --json out/ttft_mid.json

Modes (same prompts, same thread binding, vLLM's own prefix cache off so that a repeat is
served by the connector or recomputed; before each disk-hit run, the connector's files are
dropped from the page cache so that both connectors really read the disk):
  recompute        no connector: every prompt is computed
  kvtier host      kvtier: a prompt's second run loads its KV from host memory
  kvtier disk      kvtier, in a new engine process (empty host memory): loads from disk
  example disk     vLLM's ExampleConnector, in a new process: loads the files it wrote
TTFT is timed as a request for one output token. Ratios are to recompute, in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from make_model import make_model  # noqa: E402

from kvtier.bench.naive import drop_cache  # noqa: E402


def drop_page_cache(*directories: Path) -> None:
    """Evict every file under ``directories`` from the page cache, so that a "disk hit"
    reads the disk for kvtier and ExampleConnector alike."""
    drop_cache([p for d in directories for p in d.rglob("*") if p.is_file()])


def run(spec: dict, work: Path, name: str, threads: str) -> dict:
    spec_path, out_path = work / f"{name}.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update({"VLLM_CPU_OMP_THREADS_BIND": threads, "VLLM_LOGGING_LEVEL": "WARNING",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_run.py"), str(spec_path),
                    str(out_path)], check=True, env=env, cwd=ROOT)
    return json.loads(out_path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "mid"], default="tiny")
    parser.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens")
    parser.add_argument("--disk", type=Path, help="directory for the disk tier (default: a temp dir)")
    parser.add_argument("--threads", default="all", help="VLLM_CPU_OMP_THREADS_BIND for every run")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    lengths = [int(n) for n in args.lengths.split(",")]
    model = make_model(ROOT / "out" / "models" / args.model, args.model)
    work = Path(tempfile.mkdtemp(prefix="kvtier-ttft-"))
    disk = args.disk or work / "disk"
    disk.mkdir(mode=0o700, parents=True, exist_ok=True)
    example = work / "example"
    example.mkdir()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 30000, size=n).tolist() for n in lengths]
    base = {"model": str(model), "dtype": "bfloat16", "prefix_caching": False,
            "max_model_len": max(lengths) + 64, "max_num_batched_tokens": max(lengths) + 64}
    extra = {"chunk_tokens": 256, "host_capacity": "2GiB", "disk_paths": [str(disk)],
             "disk_capacity": "8GiB", "load_policy": "always"}
    once = [{"prompts": prompts, "max_tokens": 1}]
    console = Console()
    try:
        console.print("[dim]recompute[/dim]")
        recompute = run({**base, "phases": once * 2}, work, "recompute", args.threads)
        console.print("[dim]kvtier: store, then host hits[/dim]")
        host = run({**base, "connector": "kvtier", "extra": extra, "phases": once * 2}, work,
                   "kvtier-host", args.threads)
        console.print("[dim]kvtier: new process, disk hits[/dim]")
        drop_page_cache(disk)
        disk_run = run({**base, "connector": "kvtier", "extra": extra, "phases": once}, work,
                       "kvtier-disk", args.threads)
        console.print("[dim]ExampleConnector: store, then load in a new process[/dim]")
        ex = {**base, "connector": "example", "extra": {"path": str(example)}}
        run({**ex, "phases": once}, work, "example-store", args.threads)
        drop_page_cache(example)
        example_run = run({**ex, "phases": once}, work, "example-load", args.threads)
    finally:
        if args.disk is None:
            shutil.rmtree(work, ignore_errors=True)

    rows = []
    for i, n in enumerate(lengths):
        base_s = min(recompute["phases"][0][i]["seconds"], recompute["phases"][1][i]["seconds"])
        figures = {"recompute": (base_s, 0),
                   "kvtier host": (host["phases"][1][i]["seconds"], host["phases"][1][i]["cached"]),
                   "kvtier disk": (disk_run["phases"][0][i]["seconds"], disk_run["phases"][0][i]["cached"]),
                   "example disk": (example_run["phases"][0][i]["seconds"],
                                    example_run["phases"][0][i]["cached"])}
        for mode, (seconds, cached) in figures.items():
            rows.append({"tokens": n, "mode": mode, "ttft_s": seconds, "hit_tokens": cached,
                         "vs_recompute": seconds / base_s})
    table = Table(title=f"TTFT, {args.model} model (ratios to recompute, same run)")
    for column in ("prompt tokens", "mode", "TTFT s", "hit tokens", "x recompute"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["tokens"]), row["mode"], f"{row['ttft_s']:.3f}",
                      str(row["hit_tokens"]), f"{row['vs_recompute']:.3f}")
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "rows": rows,
                                         "kvtier_disk_counters": disk_run["kvtier"]}, indent=2))


if __name__ == "__main__":
    main()
