"""A fleet of vLLM engines on one node: one shared kvtier directory versus a private cache
each, on a RAG-like load spread over the engines, and one engine with the whole load.

    python scripts/fleet.py                              # tiny model, 4 engines (minutes)
    python scripts/fleet.py --model mid --json out/fleet_mid.json
    python scripts/fleet.py --dir /mnt/kvtier-ram        # the cache on a fast device

Every request is one of ``--docs`` documents of ``--doc-tokens`` tokens followed by a new
question. A first round sends every document once, document i to engine i mod ``--engines``
(so in each arm every document is computed once, somewhere). After ``--settle`` seconds,
``--rounds`` rounds: in each, every engine gets ``--batch`` requests on documents drawn at
random, sent together; the engines start each round together (a barrier), and every arm
gets the same draws. The engines share this machine's cores, so each runs with
``OMP_WAIT_POLICY=PASSIVE`` (``--omp-wait``): an idle engine's OpenMP threads spinning for
work would take the cores from the engines that have some.

Arms (vLLM's prefix cache on in every engine, limited to ``--gpu-share`` of what the load
keeps, as in scripts/workload.py):
  shared    the engines write one directory, each its own segment (``share_writers`` =
            engines), and load each other's documents from it
  private   each engine its own directory, ``disk_capacity`` / engines each (the same total)
  one       one engine with the whole load: each round's requests of every engine together

Reported per arm, over the timed rounds: seconds (first start to last end over the
engines), prompt tokens per second, and the share of prompt tokens served from a cache;
ratios are taken in this run. For the shared arm also the time from a commit to a hit:
engine 0 computes ``--probes`` new documents one at a time while the others watch their
scheduler side for every chunk of each (scripts/vllm_run.py ``watch``); the figure is the
time from the end of engine 0's request to the moment another engine's lookup would hit it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from engine_host import EngineHost  # noqa: E402
from make_model import make_model  # noqa: E402
from ttft import engine_env  # noqa: E402

from kvtier.units import parse_size  # noqa: E402

CPU_BLOCK_TOKENS = 128  # vLLM's KV block on CPU
ENGINE_TIMEOUT_S = 3600.0  # one engine run of the load, at most


def tokens(rng: np.random.Generator, count: int) -> list[int]:
    return rng.integers(100, 30000, size=count).tolist()


def fleet_load(args, rng) -> tuple[list[list[list[int]]], list[list[list[list[int]]]]]:
    """(warm[engine] prompts, rounds[round][engine] prompts)."""
    docs = [tokens(rng, args.doc_tokens) for _ in range(args.docs)]
    ask = lambda d: docs[d] + tokens(rng, args.question_tokens)  # noqa: E731
    warm = [[ask(d) for d in range(e, args.docs, args.engines)] for e in range(args.engines)]
    rounds = [[[ask(d) for d in rng.integers(0, args.docs, size=args.batch)]
               for _ in range(args.engines)] for _ in range(args.rounds)]
    return warm, rounds


def engine_hosts(count: int, threads: str, omp_wait: str) -> list[EngineHost]:
    """One engine host a place in the fleet (vLLM imported once in each): engine ``e`` of
    every arm runs in host ``e``, the engines of one arm side by side."""
    env = {**engine_env(threads), "OMP_WAIT_POLICY": omp_wait}
    return [EngineHost(env) for _ in range(count)]


def run_together(hosts: list[EngineHost], specs: dict[str, dict], work: Path) -> dict[str, dict]:
    """Run every engine at once, each in its host; wait for all (bounded). One that fails
    ends them all (the others may wait for it at a barrier)."""
    with ThreadPoolExecutor(len(specs)) as pool:
        runs = {name: pool.submit(host.run, spec, work, name, ENGINE_TIMEOUT_S)
                for host, (name, spec) in zip(hosts, specs.items(), strict=False)}
        wait(runs.values(), return_when=FIRST_EXCEPTION)
        failed = [name for name, run in runs.items() if run.done() and run.exception()]
        if failed:
            for host in hosts:
                host.kill()
            raise SystemExit(f"engine(s) {failed} failed: {runs[failed[0]].exception()}")
    return {name: run.result() for name, run in runs.items()}


def arm_specs(arm: str, args, base: dict, warm, rounds, probes, work: Path) -> dict[str, dict]:
    n = args.engines
    gate = work / f"{arm}-gate"
    gate.mkdir()
    capacity = parse_size(args.disk_capacity)
    specs = {}
    engines = 1 if arm == "one" else n
    for e in range(engines):
        name = f"{arm}-{e}"
        if arm == "private":
            path, share = work / "cache" / name, {"disk_capacity": capacity // n, "share_refresh": "off"}
        elif arm == "shared":
            path, share = work / "cache" / "shared", {
                "disk_capacity": capacity, "share_writers": n, "share_refresh": args.share_refresh,
                "instance_id": f"engine-{e}"}
        else:
            path, share = work / "cache" / "one", {"disk_capacity": capacity // n}
        path.mkdir(parents=True, mode=0o700, exist_ok=True)
        extra = {"chunk_tokens": 256, "host_capacity": args.host_capacity,
                 "disk_paths": [str(path)], "load_policy": "always", **share}
        barrier = {"dir": str(gate), "name": str(e), "count": engines}
        mine = ([p for w in warm for p in w], [[p for w in r for p in w] for r in rounds]) \
            if arm == "one" else (warm[e], [r[e] for r in rounds])
        phases = [{"prompts": mine[0], "together": True, "max_tokens": args.max_tokens,
                   "barrier": barrier}]
        phases += [{"prompts": r, "together": True, "max_tokens": args.max_tokens,
                    "barrier": barrier, "sleep": args.settle if i == 0 else 0}
                   for i, r in enumerate(mine[1])]
        if arm == "shared" and probes:
            if e == 0:
                phases.append({"prompts": probes, "max_tokens": 1, "barrier": barrier,
                               "sleep": 0.5})
            else:
                phases.append({"watch": probes, "timeout": 120, "barrier": barrier})
        specs[name] = {**base, "connector": "kvtier", "extra": extra, "phases": phases}
    return specs


def commit_to_hit(outs: dict[str, dict], rounds: int) -> list[float]:
    committed = [r["end"] for r in outs["shared-0"]["phases"][1 + rounds]]
    delays = []
    for name, out in outs.items():
        if name != "shared-0":
            for at, seen in zip(committed, out["phases"][1 + rounds], strict=True):
                delays.append(seen["visible_at"] - at if seen["visible_at"] else float("inf"))
    return delays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "mid"], default="tiny")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=2048)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2, help="requests per engine and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--probes", type=int, default=4, help="documents timed from commit to hit")
    parser.add_argument("--gpu-share", type=float, default=0.4,
                        help="each engine's vLLM KV cache as a share of what the load keeps")
    parser.add_argument("--host-capacity", default="1GiB", help="kvtier's host tier, per engine")
    parser.add_argument("--disk-capacity", default="8GiB", help="the fleet's disk, all engines")
    parser.add_argument("--share-refresh", default="1s")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds between the first round and the timed ones (default 3: "
                             "what the first round wrote is then visible fleet-wide)")
    parser.add_argument("--omp-wait", default="PASSIVE", help="OMP_WAIT_POLICY of every engine")
    parser.add_argument("--dir", type=Path, help="where the caches go (default: a temporary "
                                                 "directory on the root disk)")
    parser.add_argument("--threads", default="all", help="VLLM_CPU_OMP_THREADS_BIND for every engine")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    warm, rounds = fleet_load(args, rng)
    probes = [tokens(rng, args.doc_tokens) for _ in range(args.probes)]
    length = args.doc_tokens + args.question_tokens + args.max_tokens
    request_blocks = -(-length // CPU_BLOCK_TOKENS)
    footprint = args.docs * length
    blocks = max(int(args.gpu_share * footprint / CPU_BLOCK_TOKENS),
                 (args.batch * args.engines + 1) * request_blocks)
    model = make_model(ROOT / "out" / "models" / args.model, args.model)
    base = {"model": str(model), "dtype": "bfloat16", "prefix_caching": True,
            "max_model_len": length + 64, "max_num_batched_tokens": 8192, "num_gpu_blocks": blocks}
    console = Console()
    console.print(f"[dim]vLLM's KV cache: {blocks} blocks per engine[/dim]")
    prompt_tokens = sum(len(p) for r in rounds for w in r for p in w)
    rows, delays = {}, []
    hosts = engine_hosts(args.engines, args.threads, args.omp_wait)
    with tempfile.TemporaryDirectory(prefix="kvtier-fleet-", dir=args.dir) as tmp, \
            contextlib.ExitStack() as stack:
        for host in hosts:
            stack.callback(host.close)
        for arm in ("shared", "private", "one"):
            console.print(f"[dim]{arm}[/dim]")
            work = Path(tmp) / arm
            work.mkdir()
            outs = run_together(hosts, arm_specs(arm, args, base, warm, rounds, probes, work),
                                work)
            timed = [r for out in outs.values() for ph in out["phases"][1:1 + args.rounds]
                     for r in ph]
            seconds = max(r["end"] for r in timed) - min(r["start"] for r in timed)
            rows[arm] = {"engines": len(outs), "seconds": seconds,
                         "prompt_tokens_per_s": prompt_tokens / seconds,
                         "cached_share": sum(r["cached"] for r in timed) / prompt_tokens,
                         "kvtier": {name: out["kvtier"] for name, out in outs.items()}}
            if arm == "shared" and args.probes:
                delays = commit_to_hit(outs, args.rounds)
    for row in rows.values():
        row["vs_private"] = row["prompt_tokens_per_s"] / rows["private"]["prompt_tokens_per_s"]
    names = {"shared": "shared directory", "private": "private caches", "one": "one engine, whole load"}
    table = Table(title=f"{args.engines} engines, {args.rounds} rounds of {args.batch} requests each "
                        f"on {args.docs} documents of {args.doc_tokens} tokens, {args.model} model "
                        f"(same run)")
    for column in ("arm", "engines", "seconds", "prompt tokens/s", "x private", "prompt tokens from a cache"):
        table.add_column(column, justify="right")
    for arm, row in rows.items():
        table.add_row(names[arm], str(row["engines"]), f"{row['seconds']:.2f}",
                      f"{row['prompt_tokens_per_s']:.0f}", f"{row['vs_private']:.2f}",
                      f"{row['cached_share']:.1%}")
    console.print(table)
    gap = (rows["one"]["cached_share"] - rows["shared"]["cached_share"]) * 100
    console.print(f"shared vs private: {rows['shared']['vs_private']:.2f}x fleet prompt tokens/s; "
                  f"hit share {gap:+.1f} points below one engine with the whole load")
    if delays:
        console.print(f"commit to hit in another engine (share_refresh {args.share_refresh}): "
                      f"median {statistics.median(delays):.2f} s, max {max(delays):.2f} s "
                      f"over {len(delays)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "gpu_blocks": blocks, "rows": rows,
                                         "commit_to_hit_s": delays}, indent=2))


if __name__ == "__main__":
    main()
