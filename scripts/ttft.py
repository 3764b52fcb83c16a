"""Time to first token on long prompts: recompute, kvtier (host and disk hits), and vLLM's
ExampleConnector, each in its own engine process, all in one run; LMCache as a peer on request.

    python scripts/ttft.py                       # tiny model, 1k/2k/4k tokens (a minute or two)
    python scripts/ttft.py --model mid --lengths 1024,4096,8192 --json out/ttft_mid.json
    python scripts/ttft.py --peers lmcache       # also LMCache (venv: scripts/peers/setup_lmcache.sh)
    python scripts/ttft.py --model mid --family gemma3   # a hybrid model (HMA on for kvtier)
    python scripts/ttft.py --model mid --lengths 8192 --remote   # also the remote tier (redis)
    python scripts/ttft.py --model mid --lengths 8192 --arms kvtier-disk --remote  # some arms only

Modes (same prompts, same thread binding, vLLM's own prefix cache off so that a repeat is
served by the connector or recomputed; before each disk-hit run, the connector's files are
dropped from the page cache so that every connector really reads the disk):
  recompute        no connector: every prompt is computed
  vllm prefix      no connector, vLLM's own prefix cache on: the second run hits it
  kvtier host      kvtier: a prompt's second run loads its KV from host memory
  kvtier disk      kvtier, in a new engine process (empty host memory): loads from disk
  kvtier shared    kvtier, a new engine with another instance_id on the same directory:
                   loads what the first engine wrote, from that engine's segment
  kvtier remote    (--remote) kvtier with only a remote tier (a redis-server on loopback, no
                   disk): one engine stores, a new engine (another "node": empty host
                   memory, no shared directory) loads from the store
  example disk     vLLM's ExampleConnector, in a new process: loads the files it wrote
                   (each disk arm's engine first serves an unrelated prompt: a new engine's
                   first request pays one-time costs that a serving engine has paid)
  lmcache host     LMCache multi-process mode (--peers lmcache): the second run in the same
                   engine, served from the server's L1 host memory
  lmcache disk     a new LMCache server (empty L1) and a new engine: served from its fs L2
  recompute mp     no connector, in LMCache's venv with vLLM's multiprocessing on as the
                   LMCache arms need (the other arms run in one process): their baseline
TTFT is timed as a request for one output token. Ratios are to recompute, in this run.
``--arms`` picks the arms that run (recompute always does; "kvtier disk" and "kvtier shared"
load what "kvtier host" stored, so it runs with them); ``--remote`` and ``--peers`` add theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from engine_host import EngineRunError  # noqa: E402
from make_model import FAMILIES, make_model  # noqa: E402
from peers import lmcache  # noqa: E402

from kvtier.bench.naive import drop_cache  # noqa: E402

PEER_NOTES = [
    "LMCache runs a server process that competes with the engine for this machine's cores.",
    "LMCache arms and 'recompute mp' run vLLM with multiprocessing on (LMCache breaks its "
    "single-process mode); the other arms run in one process.",
    "vLLM OffloadingConnector (CPUOffloadingSpec, TieringOffloadingSpec + fs): refused on the CPU build, "
    "'Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs' (not an arm).",
    "vLLM SimpleCPUOffloadConnector (cpu and disk): refused on the CPU build, \"AttributeError: type "
    "object '_StreamPlaceholder' has no attribute 'priority_range'\" (not an arm).",
]


def drop_page_cache(*directories: Path) -> None:
    """Evict every file under ``directories`` from the page cache, so that a "disk hit"
    reads the disk for every connector alike."""
    drop_cache([p for d in directories for p in d.rglob("*") if p.is_file()])


def engine_env(threads: str) -> dict[str, str]:
    """An engine process's environment: this one's without kvtier's variables, vLLM in one
    process bound to ``threads`` (VLLM_CPU_OMP_THREADS_BIND)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update({"VLLM_CPU_OMP_THREADS_BIND": threads, "VLLM_LOGGING_LEVEL": "WARNING",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    return env


def run(spec: dict, work: Path, name: str, threads: str, python: Path | None = None) -> dict:
    """Run ``spec`` in a new engine process; with ``python`` (a peer's venv), in that venv
    with vLLM's multiprocessing on."""
    spec_path, out_path = work / f"{name}.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = engine_env(threads)
    if python is not None:
        # In one process vLLM never reads the binding ("all": every core, unbound); its
        # multiprocess executor rejects "all", and "nobind" is the same thing there.
        env.update({**lmcache.QUIET, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind" if threads == "all" else threads})
    subprocess.run([str(python or sys.executable), str(ROOT / "scripts" / "vllm_run.py"),
                    str(spec_path), str(out_path)], check=True, env=env, cwd=ROOT)
    return json.loads(out_path.read_text())


def lmcache_arms(python: Path, base: dict, once: list, warm: list, work: Path, threads: str,
                 console: Console) -> dict:
    """LMCache host hits (second run, same engine and server), then disk hits (new server,
    new engine, L2 files out of the page cache)."""
    console.print("[dim]recompute, multiprocess engine in LMCache's venv[/dim]")
    mp = run({**base, "phases": once * 2}, work, "recompute-mp", threads, python)
    console.print("[dim]LMCache: store, then hits from the server's L1[/dim]")
    with lmcache.server(python, work, "lmcache-server-1") as srv:
        spec = {**base, "connector": "lmcache", "extra": lmcache.connector_extra(srv["port"])}
        host = run({**spec, "phases": once * 2}, work, "lmcache-host", threads, python)
        lmcache.wait_l2_settled(srv["l2"])
    console.print("[dim]LMCache: new server and new process, hits from its fs L2[/dim]")
    with lmcache.server(python, work, "lmcache-server-2") as srv:
        spec = {**base, "connector": "lmcache", "extra": lmcache.connector_extra(srv["port"])}
        drop_page_cache(srv["l2"])
        disk = run({**spec, "phases": warm + once}, work, "lmcache-disk", threads, python)
    names = ("lmcache-server-1", "lmcache-server-2")
    logs = {name: lmcache.log_lines(work / f"{name}.log") for name in names}
    retrieved = {name: lmcache.retrieved_tokens(work / f"{name}.log") for name in names}
    return {"recompute-mp": mp, "lmcache-host": host, "lmcache-disk": disk, "logs": logs,
            "retrieved": retrieved}


def remote_arm(base: dict, extra: dict, once: list, warm: list, work: Path, threads: str,
               console: Console) -> dict:
    """kvtier with a remote tier only: one engine stores, another loads from the store."""
    sys.path.insert(0, str(ROOT))
    from tests.helpers.redis_server import RedisServer

    server = RedisServer(work / "redis", "--maxmemory", "8gb").start()
    try:
        remote = {k: v for k, v in extra.items() if k not in ("disk_paths", "disk_capacity",
                                                               "share_writers")}
        spec = {**base, "connector": "kvtier", "extra": {**remote, "remote_url": server.url}}
        console.print("[dim]kvtier: store to the remote tier[/dim]")
        run({**spec, "phases": once}, work, "kvtier-remote-store", threads)
        console.print("[dim]kvtier: another engine, no disk, hits from the remote tier[/dim]")
        return run({**spec, "phases": warm + once}, work, "kvtier-remote", threads)
    finally:
        server.stop()


# the arms ``--arms`` chooses from (recompute always runs), and the arms each one needs
ARMS = ("vllm-prefix", "kvtier-host", "kvtier-disk", "kvtier-shared", "example")
NEEDS = {"kvtier-disk": "kvtier-host", "kvtier-shared": "kvtier-host"}


def chosen_arms(text: str) -> set[str]:
    """The arms named in ``text`` (comma-separated) and those they need."""
    arms = {arm.strip() for arm in text.split(",") if arm.strip()}
    unknown = sorted(arms - set(ARMS))
    if unknown:
        raise ValueError(f"--arms: unknown arm(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(ARMS)} (recompute always runs)")
    return arms | {NEEDS[arm] for arm in arms if arm in NEEDS}


# (mode, run name, phase of the hit; None: a baseline, the faster of its two runs)
MODES = [("recompute", "recompute", None), ("vllm prefix cache", "vllm-prefix", 1),
         ("kvtier host", "kvtier-host", 1),
         ("kvtier disk", "kvtier-disk", 1), ("kvtier shared", "kvtier-shared", 1),
         ("kvtier remote", "kvtier-remote", 1),
         ("example disk", "example-load", 1),
         ("recompute mp", "recompute-mp", None), ("lmcache host", "lmcache-host", 1),
         ("lmcache disk", "lmcache-disk", 1)]


def figures(i: int, runs: dict) -> dict:
    """(seconds, tokens reused, first tokens) per mode for prompt ``i``."""
    out = {}
    for mode, name, phase in MODES:
        if name not in runs:
            continue
        phases = runs[name]["phases"]
        if phase is None:
            results = [p[i] for p in phases]
            out[mode] = (min(r["seconds"] for r in results), 0, results[0]["tokens"])
        else:
            hit = phases[phase][i]
            out[mode] = (hit["seconds"], hit["cached"], hit["tokens"])
    return out


def make_rows(lengths: list[int], runs: dict) -> list[dict]:
    rows = []
    for i, n in enumerate(lengths):
        modes = figures(i, runs)
        base_s, _, base_tokens = modes["recompute"]
        for mode, (seconds, cached, tokens) in modes.items():
            rows.append({"tokens": n, "mode": mode, "ttft_s": seconds, "hit_tokens": cached,
                         "vs_recompute": seconds / base_s, "first_token": tokens,
                         "same_as_recompute": tokens == base_tokens})
    return rows


def print_table(console: Console, model: str, rows: list[dict], notes: list[str]) -> None:
    table = Table(title=f"TTFT, {model} model (ratios to recompute, same run)",
                  caption="\n".join(notes) or None)
    for column in ("prompt tokens", "mode", "TTFT s", "hit tokens", "x recompute", "token = recompute"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["tokens"]), row["mode"], f"{row['ttft_s']:.3f}", str(row["hit_tokens"]),
                      f"{row['vs_recompute']:.3f}", "yes" if row["same_as_recompute"] else "NO")
    console.print(table)


def peer_arm(who: str, arm: Callable[[], None], failed: dict[str, str], console: Console) -> None:
    """Run a peer's arm; an engine of it that fails is recorded in ``failed`` (and said),
    not the end of the run: the other arms' figures are kept."""
    try:
        arm()
    except subprocess.CalledProcessError as exc:
        failed[who] = f"an engine exited with status {exc.returncode} (its output above says why)"
        console.print(f"[red]{who} failed: {failed[who]}[/red]")
    except EngineRunError as exc:  # an engine run in an engine host: its log's tail says why
        failed[who] = str(exc).splitlines()[0]
        console.print(f"[red]{who} failed: {failed[who]}[/red]\n{exc}")


def lmcache_python(venv: Path) -> Path:
    python = lmcache.venv_python(venv)
    if python is None:
        print(f"LMCache venv missing or broken at {venv}: run {lmcache.SETUP} {venv}", file=sys.stderr)
        sys.exit(2)
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "mid"], default="tiny")
    parser.add_argument("--family", choices=FAMILIES, default="llama",
                        help="model family (scripts/make_model.py): llama, gemma3 (hybrid "
                             "sliding-window + full), mistral (sliding window), deepseek (MLA)")
    parser.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens")
    parser.add_argument("--disk", type=Path, help="directory for the disk tier (default: a temp dir)")
    parser.add_argument("--threads", default="all", help="VLLM_CPU_OMP_THREADS_BIND for every run")
    parser.add_argument("--peers", choices=["lmcache"], help="also run this peer's arms")
    parser.add_argument("--lmcache-venv", type=Path, default=ROOT / ".venv-lmcache",
                        help=f"LMCache's venv (built by {lmcache.SETUP})")
    parser.add_argument("--remote", action="store_true",
                        help="also the remote tier's arm (starts a redis-server on loopback)")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"the arms to run, of {','.join(ARMS)} (default: all of them; "
                             "recompute always runs)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    try:
        arms = chosen_arms(args.arms)
    except ValueError as exc:
        parser.error(str(exc))

    console = Console()
    peer_python = lmcache_python(args.lmcache_venv) if args.peers == "lmcache" else None
    lengths = [int(n) for n in args.lengths.split(",")]
    name = args.model if args.family == "llama" else f"{args.model}-{args.family}"
    model = make_model(ROOT / "out" / "models" / name, args.model, family=args.family)
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
             "disk_capacity": "16GiB", "share_writers": 2, "load_policy": "always"}
    once = [{"prompts": prompts, "max_tokens": 1}]
    # A new engine's first request pays one-time costs (first forward of each shape, first
    # touch of the KV cache's memory); a restarted server has served other requests before a
    # repeated prompt comes back, so the disk arms serve an unrelated prompt first.
    warm = [{"prompts": [np.random.default_rng(1).integers(100, 30000, size=min(lengths)).tolist()],
             "max_tokens": 1}]
    runs: dict = {}
    peer: dict | None = None
    failed: dict[str, str] = {}  # peers whose engine failed, and how
    try:
        console.print("[dim]recompute[/dim]")
        runs["recompute"] = run({**base, "phases": once * 2}, work, "recompute", args.threads)
        if "vllm-prefix" in arms:
            console.print("[dim]vLLM's own prefix cache: the second run hits it[/dim]")
            runs["vllm-prefix"] = run({**base, "prefix_caching": True, "phases": once * 2}, work,
                                      "vllm-prefix", args.threads)
        kvtier = {**base, "connector": "kvtier", "extra": extra}
        if "kvtier-host" in arms:
            console.print("[dim]kvtier: store, then host hits[/dim]")
            runs["kvtier-host"] = run({**kvtier, "phases": once * 2}, work, "kvtier-host", args.threads)
        if "kvtier-disk" in arms:
            console.print("[dim]kvtier: new process, disk hits[/dim]")
            drop_page_cache(disk)
            runs["kvtier-disk"] = run({**kvtier, "phases": warm + once}, work, "kvtier-disk",
                                      args.threads)
        if "kvtier-shared" in arms:
            console.print("[dim]kvtier: another engine on the directory, hits in the first's "
                          "segment[/dim]")
            drop_page_cache(disk)
            runs["kvtier-shared"] = run({**kvtier, "extra": {**extra, "instance_id": "ttft-other"},
                                         "phases": warm + once}, work, "kvtier-shared", args.threads)
        if "example" in arms:
            console.print("[dim]ExampleConnector: store, then load in a new process[/dim]")
            ex = {**base, "connector": "example", "extra": {"path": str(example)}}

            def example_arm() -> None:
                run({**ex, "phases": once}, work, "example-store", args.threads)
                drop_page_cache(example)
                runs["example-load"] = run({**ex, "phases": warm + once}, work, "example-load",
                                           args.threads)

            peer_arm("ExampleConnector", example_arm, failed, console)
        if args.remote:
            runs["kvtier-remote"] = remote_arm(base, extra, once, warm, work, args.threads, console)
        if peer_python is not None:
            def lmcache_arm() -> None:
                nonlocal peer
                peer = lmcache_arms(peer_python, base, once, warm, work, args.threads, console)
                runs.update({k: peer[k] for k in ("recompute-mp", "lmcache-host", "lmcache-disk")})

            peer_arm("LMCache", lmcache_arm, failed, console)
    finally:
        if args.disk is None:
            shutil.rmtree(work, ignore_errors=True)

    rows = make_rows(lengths, runs)
    print_table(console, name, rows, PEER_NOTES if peer else [])
    for who, how in failed.items():
        console.print(f"[red]{who}: {how}[/red]")
    if peer:
        for name, lines in peer["logs"].items():
            print(f"{name} log:")
            for line in lines:
                print(f"  {line}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        kvtier_run: dict = next((runs[n] for n in ("kvtier-host", "kvtier-remote") if n in runs), {})
        result = {"model": name, "kv_cache_groups": kvtier_run.get("kv_cache_groups"),
                  "rows": rows, "arms": sorted(runs), "failed": failed}
        for counters, arm in (("kvtier_disk_counters", "kvtier-disk"),
                              ("kvtier_remote_counters", "kvtier-remote")):
            if arm in runs:
                result[counters] = runs[arm].get("kvtier")
        if peer:
            result.update({"notes": PEER_NOTES, "lmcache_logs": peer["logs"],
                           "lmcache_retrieved_tokens": peer["retrieved"]})
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
