"""Serving throughput on repeated prefixes: vLLM's own prefix cache alone, with kvtier, with
vLLM's ExampleConnector and with LMCache beside its own baseline (``--peers example,lmcache``).

    python scripts/workload.py                          # tiny model, RAG load (a few minutes)
    python scripts/workload.py --model mid --json out/workload_mid.json
    python scripts/workload.py --model mid --peers example,lmcache  # scripts/peers/setup_lmcache.sh
    python scripts/workload.py --model mid --pattern chat --json out/workload_chat.json

``--pattern rag``: ``--docs`` documents of ``--doc-tokens`` tokens; every request is one
document followed by a new question of ``--question-tokens`` tokens. A first round sends every
document once (both engines compute them all); then ``--rounds`` rounds of ``--batch``
requests sent together, each on a document drawn at random.

``--pattern chat``: ``--docs`` conversations that open with the same system prompt of
``--doc-tokens`` tokens; a first round opens every conversation, then each of ``--rounds``
rounds takes ``--batch`` conversations drawn at random one turn further: the history so far
(earlier prompts and replies) and a new message of ``--question-tokens`` tokens.

Every request asks for ``--max-tokens`` tokens, and every engine gets the same draws. vLLM's
prefix cache is on in every engine and limited to ``--gpu-share`` of what the whole load would keep
(at least the running batch), as when a GPU holds the running batch but not every document or
conversation: what it evicted is recomputed by vLLM alone and loaded by kvtier (from host
memory, or with a small ``--host-capacity`` mostly from disk). Reported per engine: the
seconds of the timed rounds, prompt tokens per second, and the share of prompt tokens served
from a cache; the ratios are taken in this run. ExampleConnector saves a request's KV under its
prompt rounded down to whole blocks, so it hits a document (or history) followed by a question
shorter than a block, and recomputes everything else. LMCache's engine runs with vLLM's
multiprocessing on (it breaks the single-process mode the others use), so its ratio is to
"prefix cache only (multiprocess)", run in its venv; its server's L1 is ``--host-capacity``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from engine_host import EngineHost  # noqa: E402
from make_model import make_model  # noqa: E402
from peers import lmcache  # noqa: E402
from ttft import engine_env, lmcache_python, peer_arm, run  # noqa: E402  (one engine run in its own process)

from kvtier.units import parse_size  # noqa: E402

CPU_BLOCK_TOKENS = 128  # vLLM's KV block on CPU
ENGINE_TIMEOUT_S = 3600.0  # one engine run of the load, at most


def tokens(rng: np.random.Generator, count: int) -> list[int]:
    return rng.integers(100, 30000, size=count).tolist()


def phase(prompts: list[list[int]], max_tokens: int) -> dict:
    return {"prompts": prompts, "together": True, "max_tokens": max_tokens}


def rag_load(args, rng) -> tuple[list[dict], list[dict], int, int]:
    """(first round, timed rounds, longest request, tokens the whole load would keep)."""
    docs = [tokens(rng, args.doc_tokens) for _ in range(args.docs)]
    warm = [phase([d + tokens(rng, args.question_tokens) for d in docs], args.max_tokens)]
    rounds = [phase([docs[d] + tokens(rng, args.question_tokens)
                     for d in rng.integers(0, args.docs, size=args.batch)], args.max_tokens)
              for _ in range(args.rounds)]
    length = args.doc_tokens + args.question_tokens + args.max_tokens
    return warm, rounds, length, args.docs * length


def chat_load(args, rng) -> tuple[list[dict], list[dict], int, int]:
    """Conversations one turn further per round; a reply enters the history as the
    assistant's turn (its tokens are drawn here, the same for both engines)."""
    system = tokens(rng, args.doc_tokens)
    history = [system + tokens(rng, args.question_tokens) for _ in range(args.docs)]
    warm = [phase([list(h) for h in history], args.max_tokens)]
    rounds = []
    for _ in range(args.rounds):
        chosen = rng.choice(args.docs, size=args.batch, replace=False)
        for c in chosen:
            history[c] += tokens(rng, args.max_tokens) + tokens(rng, args.question_tokens)
        rounds.append(phase([list(history[c]) for c in chosen], args.max_tokens))
    length = max(len(h) for h in history) + args.max_tokens
    return warm, rounds, length, sum(len(h) for h in history)


ENGINES = [("alone", "prefix cache only"), ("kvtier", "prefix cache + kvtier"),
           ("example", "prefix cache + ExampleConnector"),
           ("alone-mp", "prefix cache only (multiprocess)"), ("lmcache", "prefix cache + LMCache")]


def peer_list(text: str) -> list[str]:
    peers = [p for p in text.split(",") if p]
    unknown = set(peers) - {"example", "lmcache"}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {sorted(unknown)}: choose from example, lmcache")
    return peers


def run_engines(args, base: dict, work: Path, console: Console) -> tuple[dict, dict[str, str]]:
    """Every engine on the same load, one after the other; LMCache's (and its multiprocess
    baseline) in its venv with a server whose L1 is as large as kvtier's host tier. A peer's
    engine that fails is reported (its output says why), not the end of the run: (the
    engines' outputs, the peers that failed and how)."""
    disk, example = work / "disk", work / "example"
    disk.mkdir(mode=0o700)
    example.mkdir()
    extra = {"chunk_tokens": 256, "host_capacity": args.host_capacity, "disk_paths": [str(disk)],
             "disk_capacity": "8GiB", "load_policy": "always"}
    specs = {"alone": base, "kvtier": {**base, "connector": "kvtier", "extra": extra},
             "example": {**base, "connector": "example", "extra": {"path": str(example)}}}
    outs: dict = {}
    failed: dict[str, str] = {}  # by engine name

    def peer(key: str, start: Callable[[], dict]) -> None:
        peer_arm(dict(ENGINES)[key], lambda: outs.__setitem__(key, start()), failed, console)

    # one after the other in one process (vLLM imported once): each is a new engine
    with EngineHost(engine_env(args.threads)) as host:
        for key, name in ENGINES[:3]:
            if key == "example" and "example" not in args.peers:
                continue
            console.print(f"[dim]{name}[/dim]")
            if key == "example":
                peer(key, lambda: host.run(specs["example"], work, "example", ENGINE_TIMEOUT_S))
            else:
                outs[key] = host.run(specs[key], work, key, ENGINE_TIMEOUT_S)
    if "lmcache" in args.peers:
        python = lmcache_python(args.lmcache_venv)
        console.print(f"[dim]{ENGINES[3][1]}[/dim]")
        outs["alone-mp"] = run(base, work, "alone-mp", args.threads, python)
        console.print(f"[dim]{ENGINES[4][1]}[/dim]")
        l1_gb = parse_size(args.host_capacity) / 1e9

        def with_server() -> dict:
            with lmcache.server(python, work, "lmcache-server", l1_gb=l1_gb) as srv:
                spec = {**base, "connector": "lmcache", "extra": lmcache.connector_extra(srv["port"])}
                return run(spec, work, "lmcache", args.threads, python)

        peer("lmcache", with_server)
    return outs, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "mid"], default="tiny")
    parser.add_argument("--pattern", choices=["rag", "chat"], default="rag")
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--doc-tokens", type=int, default=2048)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu-share", type=float, default=0.4,
                        help="vLLM's KV cache as a share of what the load keeps (default 0.4)")
    parser.add_argument("--host-capacity", default="2GiB",
                        help="kvtier's host tier and LMCache's L1 (default 2GiB: every document fits)")
    parser.add_argument("--threads", default="all", help="VLLM_CPU_OMP_THREADS_BIND for every run")
    parser.add_argument("--peers", type=peer_list, default=[],
                        help="comma-separated peers to run as well: example, lmcache")
    parser.add_argument("--lmcache-venv", type=Path, default=ROOT / ".venv-lmcache",
                        help=f"LMCache's venv (built by {lmcache.SETUP})")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    if args.pattern == "chat":
        args.batch = min(args.batch, args.docs)  # a round takes each conversation at most once
    rng = np.random.default_rng(0)
    make = chat_load if args.pattern == "chat" else rag_load
    warm, rounds, length, footprint = make(args, rng)
    request_blocks = -(-length // CPU_BLOCK_TOKENS)
    blocks = max(int(args.gpu_share * footprint / CPU_BLOCK_TOKENS), (args.batch + 1) * request_blocks)
    model = make_model(ROOT / "out" / "models" / args.model, args.model)
    base = {"model": str(model), "dtype": "bfloat16", "prefix_caching": True,
            "max_model_len": length + 64, "max_num_batched_tokens": 8192,
            "num_gpu_blocks": blocks, "phases": warm + rounds}
    console = Console()
    console.print(f"[dim]vLLM's KV cache: {blocks} blocks[/dim]")
    with tempfile.TemporaryDirectory(prefix="kvtier-workload-") as tmp:
        outs, failed = run_engines(args, base, Path(tmp), console)

    prompt_tokens = sum(len(p) for r in rounds for p in r["prompts"])
    rows = []
    for key, name in ENGINES:
        if key not in outs:
            continue
        timed = outs[key]["phases"][1:]
        seconds = sum(phase[0]["seconds"] for phase in timed)
        cached = sum(r["cached"] for phase in timed for r in phase)
        baseline = "alone-mp" if key in ("alone-mp", "lmcache") else "alone"
        rows.append({"engine": name, "key": key, "baseline": baseline, "seconds": seconds,
                     "prompt_tokens_per_s": prompt_tokens / seconds,
                     "cached_share": cached / prompt_tokens,
                     "round_seconds": [phase[0]["seconds"] for phase in timed]})
    by_key = {row["key"]: row for row in rows}
    for row in rows:
        row["vs_baseline"] = row["prompt_tokens_per_s"] / by_key[row["baseline"]]["prompt_tokens_per_s"]
    speedup = by_key["kvtier"]["vs_baseline"]
    what = "documents" if args.pattern == "rag" else "conversations opening with a system prompt"
    table = Table(title=f"{args.rounds} rounds of {args.batch} requests on {args.docs} {what} "
                        f"of {args.doc_tokens} tokens, {args.model} model (same run)",
                  caption="x own baseline: to 'prefix cache only' in the same process mode")
    for column in ("engine", "seconds", "prompt tokens/s", "x own baseline", "prompt tokens from a cache"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["engine"], f"{row['seconds']:.2f}", f"{row['prompt_tokens_per_s']:.0f}",
                      f"{row['vs_baseline']:.2f}", f"{row['cached_share']:.0%}")
    for engine in failed:
        table.add_row(engine, "failed", "-", "-", "-")
    console.print(table)
    console.print(f"throughput with kvtier: {speedup:.2f}x vLLM's prefix cache alone")
    if "lmcache" in by_key:
        ratio = by_key["kvtier"]["prompt_tokens_per_s"] / by_key["lmcache"]["prompt_tokens_per_s"]
        console.print(f"kvtier / LMCache prompt tokens/s: {ratio:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json),
                                                                "lmcache_venv": str(args.lmcache_venv)},
                                         "gpu_blocks": blocks, "rows": rows, "failed": failed,
                                         "speedup": speedup, "kvtier": outs["kvtier"]["kvtier"]}, indent=2))


if __name__ == "__main__":
    main()
