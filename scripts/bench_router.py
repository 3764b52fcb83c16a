"""vLLM OpenAI servers with kvtier behind vllm-router: each routing policy side by side, in
one run, on repeated prefixes that vLLM's own KV cache cannot hold.

    python scripts/bench_router.py                            # tiny model, every arm (minutes)
    python scripts/bench_router.py --json out/bench_router.json
    python scripts/bench_router.py --arms round_robin,kv_aware --prompts 48
    python scripts/bench_router.py --engines 4 --pattern chat --private-disks

Each arm starts ``--engines`` engines (2) afresh (empty tiers, a new disk directory) on
127.0.0.1, each pinned to a core (in turn where they outnumber the cores), with kvtier's host
tier each and one shared disk directory (``share_writers`` the engines: each engine loads
what the others wrote; with ``--private-disks`` a directory each, out of the others' reach),
vLLM's KV events published
on loopback (tests/helpers/router_fleet.py), and vllm-router 0.1.17 in front. vLLM's KV
cache holds about ``--gpu-prefixes`` requests, each host tier ``--host-share`` of all the
prefixes' bytes and each engine's disk segment ``--disk-share``: what vLLM evicts,
kvtier's tiers hold. The load is vLLM's own benchmark client
(``vllm bench serve``, dataset ``prefix_repetition``, run in a process of its own, bounded
by ``--timeout``): ``--prompts`` text prompts, ``--prefixes`` prefixes of
``--prefix-tokens`` tokens each followed by ``--suffix-tokens`` new ones, shuffled (the
same in every arm), ``--concurrency`` at once, ``--output-tokens`` each; or with
``--pattern chat`` a multi-turn load (scripts/chat_load.py): ``--prefixes`` conversations of
``--turns`` turns, each opening with ``--prefix-tokens`` tokens of its own, each later turn
the history so far (replies included) and ``--suffix-tokens`` new ones, as text or with
``--token-ids`` as token ids (the router then renders nothing), and with ``--sessions``
each turn naming its conversation (header ``X-Session-ID``). The model gets a
word-level tokenizer (word ``w{i}`` is token i), so text prompts are the ids they were
made of; the router gets a prompt's ids from the engines (their ``/v1/completions/render``).

Arms:
  round_robin    requests in turn
  cache_aware    the router's own tree of the prompts it sent where (no events)
  kv_aware       vLLM's KV events: its GPU cache's and kvtier's host (CPU), disk (STORAGE)
                 and remote (REMOTE) tiers', credited 1, 0.8, 0.3 and 0.6 a block
                 (vllm-router's defaults)
  kv_aware_gpu   kv_aware with kvtier's events held back: the GPU cache's only
                 (tests/helpers/quiet_connector.py)
``--router-args`` adds vllm-router flags to the kv_aware arms (``--kv-penalty-disk 0.8``).

Reported per arm: TTFT mean, p50, p90 and p99, requests per second, their ratios to round_robin
in this run; per engine the requests served and the share of their prompt tokens found in
vLLM's GPU cache and in kvtier (vLLM's metrics), kvtier's loads by tier (its metrics:
``host``, ``disk`` = this engine's segment, ``shared`` = the others', ``remote`` = the store
with ``--remote``: no disk tier, both engines on one redis-server); for kv_aware arms
the share of the router's lookups that found some engine holding part of the prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from chat_load import ChatShape, histories, run_chat  # noqa: E402
from make_model import make_model  # noqa: E402

from tests.helpers.redis_server import RedisServer  # noqa: E402
from tests.helpers.router_fleet import (  # noqa: E402
    BLOCK,
    SERVED,
    EngineConfig,
    Fleet,
    free_port,
    scrape,
    total,
)
from tests.helpers.subprocesses import die_with_parent  # noqa: E402
from tests.helpers.vllm_engine import engine_env  # noqa: E402

CHUNK = 256  # kvtier's chunk_tokens
ARMS = {"round_robin": ("round_robin", False), "cache_aware": ("cache_aware", False),
        "kv_aware": ("kv_aware", False), "kv_aware_gpu": ("kv_aware", True)}
TIERS = ("host", "disk", "shared", "remote")
BENCH = ("from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
         "from vllm.benchmarks.serve import add_cli_args, main\n"
         "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args())")
QUIET = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}


def word_model(model: Path) -> Path:
    """``model`` with a word-level tokenizer (word ``w{i}`` is token i), in a folder of its own
    beside it (its files linked): text then tokenizes to the ids it was made of."""
    out = model.parent / f"{model.name}-words"
    if (out / "tokenizer.json").exists():
        return out
    out.mkdir(exist_ok=True)
    for path in model.iterdir():
        if not (out / path.name).exists():
            (out / path.name).symlink_to(path.resolve())
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(out)
    return out


def chunk_bytes(model: Path) -> int:
    """A chunk's KV in float32: K and V of every layer's KV heads."""
    c = json.loads((model / "config.json").read_text())
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head * 4 * CHUNK


def port_pair() -> int:
    """A free port whose next one is free too (kvtier's scheduler side and its worker)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def disk_config(args, disk: Path, engine: int, segment: int) -> dict:
    """kvtier's disk tier for ``engine``: its segment of the shared directory, or with
    ``--private-disks`` a directory of its own (the other engine's chunks out of reach);
    with ``--remote`` none, and the arm's redis-server as the remote store instead."""
    if args.remote:
        return {"remote_url": args.remote_url}
    if args.private_disks:
        disk = disk / f"engine-{engine}"
        disk.mkdir(mode=0o700)
        return {"disk_paths": [str(disk)], "disk_capacity": segment, "share_refresh": "off"}
    return {"disk_paths": [str(disk)], "disk_capacity": args.engines * segment,
            "share_writers": args.engines,
            "instance_id": f"engine-{engine}"}


def engine_configs(args, model: Path, disk: Path, quiet: bool) -> list[EngineConfig]:
    if args.pattern == "chat":
        longest, kept = args.shape.longest, args.prefixes * args.shape.longest
    else:
        longest = args.prefix_tokens + args.suffix_tokens + args.output_tokens
        kept = args.prefixes * args.prefix_tokens
    in_flight = -(-args.concurrency // args.engines)  # requests an engine runs at once, mean
    gpu_blocks = max(args.gpu_prefixes, in_flight) * -(-longest // BLOCK) + 1
    prefixes = kept // CHUNK * chunk_bytes(model)  # bytes: every prefix (every whole history)
    model_limit = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    host, segment = int(args.host_share * prefixes), int(args.disk_share * prefixes)
    cores = os.cpu_count() or 1
    disk.mkdir(mode=0o700)
    return [EngineConfig(model, {"chunk_tokens": CHUNK, "host_capacity": host,
                                 **disk_config(args, disk, i, segment),
                                 "load_policy": "always", "metrics_port": port_pair()},
                         gpu_blocks, max_model_len=min((gpu_blocks - 1) * BLOCK, model_limit),
                         quiet=quiet, cpu=i % cores) for i in range(args.engines)]


def bench_serve(args, router: str, tokenizer: Path, out: Path) -> dict:
    """vLLM's benchmark client against ``router``; its result (per-request TTFTs included)."""
    argv = [sys.executable, "-c", BENCH, "--backend", "openai", "--base-url", router,
            "--endpoint", "/v1/completions", "--model", SERVED, "--tokenizer", str(tokenizer),
            "--dataset-name", "prefix_repetition", "--num-prompts", str(args.prompts),
            "--prefix-repetition-prefix-len", str(args.prefix_tokens),
            "--prefix-repetition-suffix-len", str(args.suffix_tokens),
            "--prefix-repetition-num-prefixes", str(args.prefixes),
            "--prefix-repetition-output-len", str(args.output_tokens),
            "--max-concurrency", str(args.concurrency), "--seed", "0", "--ignore-eos",
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99",
            "--ready-check-timeout-sec", "60", "--num-warmups", "0", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(out.parent),
            "--result-filename", out.name]
    with open(out.with_suffix(".log"), "wb") as log:
        subprocess.run(argv, cwd=ROOT, env={**os.environ, **QUIET}, stdout=log,
                       stderr=subprocess.STDOUT, timeout=args.timeout, check=True,
                       preexec_fn=die_with_parent)
    return json.loads(out.read_text())


def chat(args, router: str) -> dict:
    """The multi-turn load (scripts/chat_load.py) against ``router``: its figures under the
    names of vLLM's benchmark client's result."""
    result = run_chat(router, args.shape, args.concurrency, seed=0, timeout=args.timeout,
                      token_ids=args.token_ids, sessions=args.sessions)
    if not result.ttfts_s:
        raise RuntimeError(f"chat: every turn failed, first: {result.errors[0]}")
    if result.errors:
        print(f"chat: {result.failed} turns failed, first: {result.errors[0]}", file=sys.stderr)
    ttfts = np.array(result.ttfts_s) * 1000  # some turn answered (else raised above)
    tokens = sum(len(p) + args.shape.reply for turns in histories(args.shape, 0) for p in turns)
    return {"completed": len(result.ttfts_s), "failed": result.failed,
            "duration": result.duration, "mean_ttft_ms": float(ttfts.mean()),
            **{f"p{q}_ttft_ms": float(np.percentile(ttfts, q)) for q in (50, 90, 99)},
            "mean_e2el_ms": float(np.mean(result.e2el_s) * 1000),
            "request_throughput": len(result.ttfts_s) / result.duration,
            "total_token_throughput": tokens / result.duration, "ttfts": result.ttfts_s}


def engine_counters(fleet: Fleet) -> list[dict[str, float]]:
    out = []
    for engine in fleet.engines:
        vllm = scrape(f"{engine.url}/metrics")
        kvtier = scrape(engine.metrics) if engine.metrics else {}
        out.append({"requests": total(vllm, "vllm:request_success_total"),
                    "prompt_tokens": total(vllm, "vllm:prompt_tokens_total"),
                    "gpu_hit_tokens": total(vllm, "vllm:prefix_cache_hits_total"),
                    "kvtier_hit_tokens": total(vllm, "vllm:external_prefix_cache_hits_total"),
                    **{f"{tier}_chunks": total(kvtier, "kvtier_chunks_loaded_total", tier=tier)
                       for tier in TIERS}})
    return out


def run_arm(arm: str, args, model: Path, work: Path, console: Console) -> dict:
    policy, quiet = ARMS[arm]
    work.mkdir()
    env = {**engine_env(), **QUIET, "OMP_WAIT_POLICY": "PASSIVE"}
    store = RedisServer(work / "redis").start() if args.remote else None
    args.remote_url = store.url if store else None
    with Fleet(work, env) as fleet, contextlib.ExitStack() as stop:
        if store is not None:
            stop.callback(store.stop)
        console.print(f"[dim]{arm}: starting {args.engines} engines and the router ({policy})[/dim]")
        fleet.start_engines(engine_configs(args, model, work / "disk", quiet))
        extra = tuple(args.router_args.split()) if policy == "kv_aware" else ()
        router = fleet.start_router(policy, extra=extra)
        before = engine_counters(fleet)
        result = (chat(args, router) if args.pattern == "chat"
                  else bench_serve(args, router, model, work / f"{arm}.json"))
        after = engine_counters(fleet)
        lookups = scrape(fleet.router_metrics or "")
    engines = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    hits = total(lookups, "vllm_router_kv_placement_lookups_total", result="hit")
    asked = total(lookups, "vllm_router_kv_placement_lookups_total")
    keys = ("completed", "failed", "duration", "mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms",
            "p99_ttft_ms", "mean_e2el_ms", "request_throughput", "total_token_throughput")
    return {"policy": policy, "kvtier_events": not quiet, **{k: result[k] for k in keys},
            "ttfts_s": result["ttfts"], "engines": engines,
            "router_lookups_with_holder": hits / asked if asked else None,
            "router_args": list(extra),
            "router_decisions": {k: v for k, v in lookups.items()
                                 if k.startswith("vllm_router_prefix_routing_decisions_total")}}


def log_tails(work: Path, console: Console) -> None:
    """The end of every log of a failed arm (its folder goes with the run)."""
    for log in sorted(work.glob("*.log")):
        console.print(f"[red]{log.name}:[/red]\n{log.read_text(errors='replace')[-3000:]}")


def ratio(row: dict, base: dict | None, key: str) -> str:
    return f"{row[key] / base[key]:.2f}" if base else "-"


def share(engine: dict, key: str) -> str:
    return f"{engine[key] / engine['prompt_tokens']:.0%}" if engine["prompt_tokens"] else "-"


def print_tables(console: Console, rows: dict[str, dict], title: str) -> None:
    base = rows.get("round_robin")
    table = Table(title=title)
    for column in ("arm", "TTFT mean ms", "p50 ms", "p90 ms", "p99 ms", "TTFT x rr", "p50 x rr",
                   "req/s", "req/s x rr", "router lookups with a holder", "failed"):
        table.add_column(column, justify="right")
    for arm, r in rows.items():
        lookups = r["router_lookups_with_holder"]
        table.add_row(arm, f"{r['mean_ttft_ms']:.1f}", f"{r['p50_ttft_ms']:.1f}",
                      f"{r['p90_ttft_ms']:.1f}", f"{r['p99_ttft_ms']:.1f}",
                      ratio(r, base, "mean_ttft_ms"), ratio(r, base, "p50_ttft_ms"),
                      f"{r['request_throughput']:.2f}", ratio(r, base, "request_throughput"),
                      "-" if lookups is None else f"{lookups:.0%}", str(r["failed"]))
    console.print(table)
    engines = Table(title="per engine: prompt tokens from vLLM's GPU cache and from kvtier; "
                          "kvtier's loads in chunks by tier")
    for column in ("arm", "engine", "requests", "from GPU", "from kvtier", *TIERS):
        engines.add_column(column, justify="right")
    for arm, r in rows.items():
        for i, e in enumerate(r["engines"]):
            engines.add_row(arm, str(i), f"{e['requests']:.0f}", share(e, "gpu_hit_tokens"),
                            share(e, "kvtier_hit_tokens"), *[f"{e[f'{t}_chunks']:.0f}" for t in TIERS])
    console.print(engines)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "mid"], default="tiny")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {','.join(ARMS)}")
    parser.add_argument("--engines", type=int, default=2, help="engines behind the router")
    parser.add_argument("--pattern", choices=["prefix_repetition", "chat"],
                        default="prefix_repetition",
                        help="vLLM's client on repeated prefixes, or a multi-turn chat load "
                             "(scripts/chat_load.py): --prefixes conversations of --turns turns "
                             "opening with --prefix-tokens, each later message --suffix-tokens")
    parser.add_argument("--turns", type=int, default=6, help="turns of a conversation (chat)")
    parser.add_argument("--token-ids", action="store_true",
                        help="chat prompts as token ids, not text: the router need not ask the "
                             "engines for them (/v1/completions/render)")
    parser.add_argument("--sessions", action="store_true",
                        help="each chat turn names its conversation (X-Session-ID), for the "
                             "router's session affinity (--router-args "
                             "'--kv-aware-session-affinity-ttl-secs N')")
    parser.add_argument("--prompts", type=int, default=160, help="prompts (prefix_repetition)")
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--gpu-prefixes", type=int, default=2,
                        help="requests vLLM's KV cache holds, per engine")
    parser.add_argument("--host-share", type=float, default=0.6,
                        help="share of all prefixes one engine's host tier holds")
    parser.add_argument("--disk-share", type=float, default=3.0,
                        help="share of all prefixes one engine's disk segment holds (default 3: "
                             "every prefix and every prompt's tail)")
    parser.add_argument("--router-args", default="",
                        help="more vllm-router flags for the kv_aware arms (e.g. "
                             "'--kv-penalty-disk 0.8')")
    parser.add_argument("--private-disks", action="store_true",
                        help="a disk directory each instead of one shared directory")
    parser.add_argument("--remote", action="store_true",
                        help="no disk tier: one redis-server a arm, both engines' remote store")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one arm's load")
    parser.add_argument("--dir", type=Path, help="where the disk directories go (default: a "
                                                 "temporary directory on the root disk)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    if unknown := sorted(set(arms) - set(ARMS)):
        parser.error(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    args.arms = arms
    args.shape = ChatShape(args.prefixes, args.turns, args.prefix_tokens, args.suffix_tokens,
                           args.output_tokens)
    return args


def main() -> None:
    args = arguments()
    # a SIGTERM ends the run as an exception would: every engine's process group is ended
    # (vLLM's engine core too, which outlives its API server otherwise)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    console = Console(width=220)
    model = word_model(make_model(ROOT / "out" / "models" / args.model, args.model))
    rows = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-router-", dir=args.dir) as tmp:
        for arm in args.arms:
            try:
                rows[arm] = run_arm(arm, args, model, Path(tmp) / arm, console)
            except Exception:
                log_tails(Path(tmp) / arm, console)
                raise
    disks = ("one remote store (redis-server), no disk" if args.remote else
             "a disk directory each" if args.private_disks else "one shared disk directory")
    load = (f"{args.prefixes} conversations of {args.turns} turns opening with "
            f"{args.prefix_tokens} tokens (+{args.output_tokens} +{args.suffix_tokens} a turn)"
            if args.pattern == "chat" else
            f"{args.prompts} prompts on {args.prefixes} prefixes of {args.prefix_tokens} tokens "
            f"(+{args.suffix_tokens})")
    title = (f"{load}, {args.concurrency} at once, {args.engines} engines, {disks}, "
             f"{args.model} model (ratios to round_robin, same run)")
    print_tables(console, rows, title)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
