"""A prefill/decode split through kvtier's pool against two colocated engines, behind
vllm-router, in one run: long prompts, long outputs, 1, 4 and 16 requests at once.

    python scripts/bench_pd.py                          # tiny model, both arms (minutes)
    python scripts/bench_pd.py --json out/bench_pd.json
    python scripts/bench_pd.py --levels 1:8,4:16 --output-tokens 64

Arms, each on two vLLM OpenAI servers on 127.0.0.1 with kvtier, each pinned to a core of
its own, on one shared disk directory (``share_writers`` 2):
  split      a ``kv_producer`` engine (core 0) and a ``kv_consumer`` engine (core 1, vLLM's
             prefix cache off: every prompt token it did not compute came from kvtier),
             behind vllm-router's PD mode: each request is prefilled on the producer
             (``max_tokens`` 1), handed off through the pool, and decoded on the consumer
  colocated  two ``kv_both`` engines behind vllm-router ``round_robin``: each prefills and
             decodes its own requests
Every level (``--levels``, ``CONCURRENCY:PROMPTS``) of every arm starts its engines and
router afresh (empty tiers, a new directory): the load repeats the same prompts (seed 0) at
every level, and an engine that had served them would find them in its tiers. The load is
vLLM's own client as scripts/bench_router.py runs it (``vllm bench serve``, dataset
``prefix_repetition`` with a prefix of its own per prompt: ``--prompt-tokens`` tokens each,
``--output-tokens`` out, EOS ignored).

Reported per level and arm: TTFT p50/p99, ITL p50/p99, output tokens/s and the split's
ratios to colocated in this run; for the split's consumer, kvtier's hand-offs waited for
and incomplete (its metrics), the prompt tokens vLLM took from kvtier against those it was
sent, and its own mean TTFT (vLLM's histogram: from the request's arrival there, the
hand-off's wait and load included).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_router import CHUNK, QUIET, bench_serve, log_tails, port_pair, word_model  # noqa: E402
from make_model import make_model  # noqa: E402

from tests.helpers.router_fleet import BLOCK, EngineConfig, Fleet, scrape, total  # noqa: E402
from tests.helpers.vllm_engine import engine_env  # noqa: E402

ARMS = ("split", "colocated")
SUFFIX = 64  # each prompt's tokens after its prefix
HANDOFF = ("kvtier_handoffs_waited_total", "kvtier_handoffs_incomplete_total",
           "kvtier_handoff_tokens_recomputed_total")
LOADS = ("kvtier_load_cut_chunks_total", "kvtier_load_failures_total", "kvtier_room_waits_total",
         "kvtier_chunks_loaded_total")  # in the JSON: where a consumer's hits went
VLLM = ("vllm:request_success_total", "vllm:prompt_tokens_total",
        "vllm:external_prefix_cache_hits_total", "vllm:time_to_first_token_seconds_sum",
        "vllm:time_to_first_token_seconds_count")


def engine_configs(arm: str, args, model: Path, pool: Path) -> list[EngineConfig]:
    """The split's producer and consumer, or two colocated engines: core 0 and core 1."""
    blocks = -(-(args.prompt_tokens + args.output_tokens) // BLOCK)
    gpu_blocks = max(level for level, _ in args.levels) * blocks + 1
    pool.mkdir(mode=0o700)
    configs = []
    for i in range(2):
        extra = {"chunk_tokens": CHUNK, "host_capacity": "512MiB", "disk_paths": [str(pool)],
                 "disk_capacity": "4GiB", "share_writers": 2, "instance_id": f"engine-{i}",
                 "metrics_port": port_pair()}
        role = ("kv_producer", "kv_consumer")[i] if arm == "split" else "kv_both"
        # twice the tokens a request takes: vLLM refuses a text prompt of more than 6
        # characters a token of max_model_len, and a word here is up to 7 ("w31999 ")
        configs.append(EngineConfig(model, extra, gpu_blocks, max_model_len=2 * blocks * BLOCK,
                                    role=role, events=False, cpu=i,
                                    prefix_caching=role != "kv_consumer"))
    return configs


def counters(fleet: Fleet) -> list[dict[str, float]]:
    """Per engine: vLLM's counters of ``VLLM`` and kvtier's of ``HANDOFF``."""
    out = []
    for engine in fleet.engines:
        vllm, kvtier = scrape(f"{engine.url}/metrics"), scrape(engine.metrics or "")
        out.append({**{name: total(vllm, name) for name in VLLM},
                    **{name: total(kvtier, name) for name in HANDOFF + LOADS}})
    return out


def load(args, concurrency: int, prompts: int) -> argparse.Namespace:
    """scripts/bench_router.py's load arguments for one level: a prefix per prompt."""
    return argparse.Namespace(prompts=prompts, prefixes=prompts, concurrency=concurrency,
                              prefix_tokens=args.prompt_tokens - SUFFIX, suffix_tokens=SUFFIX,
                              output_tokens=args.output_tokens, timeout=args.timeout)


def latencies(result: dict) -> dict:
    """TTFT and ITL percentiles in ms from the client's per-request results."""
    ttfts = np.array(result["ttfts"]) * 1000
    itls = np.array([t for request in result["itls"] for t in request]) * 1000
    return {"ttft_p50": float(np.percentile(ttfts, 50)), "ttft_p99": float(np.percentile(ttfts, 99)),
            "itl_p50": float(np.percentile(itls, 50)), "itl_p99": float(np.percentile(itls, 99))}


def run_level(arm: str, args, model: Path, work: Path, level: tuple[int, int],
              console: Console) -> dict:
    concurrency, prompts = level
    work.mkdir()
    env = {**engine_env(), **QUIET, "OMP_WAIT_POLICY": "PASSIVE"}
    with Fleet(work, env) as fleet:
        console.print(f"[dim]{arm}, {concurrency} at once: starting two engines and the "
                      f"router[/dim]")
        fleet.start_engines(engine_configs(arm, args, model, work / "pool"))
        if arm == "split":
            router = fleet.start_pd_router(fleet.engines[0], fleet.engines[1])
        else:
            router = fleet.start_router("round_robin")
        before = counters(fleet)
        result = bench_serve(load(args, concurrency, prompts), router, model, work / "load.json")
        time.sleep(1.0)  # vLLM counts a request just after its reply
        after = counters(fleet)
    engines = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    keys = ("completed", "failed", "duration", "output_throughput")
    return {"arm": arm, "concurrency": concurrency, "prompts": prompts,
            **{k: result[k] for k in keys}, **latencies(result), "engines": engines}


def ratio(row: dict, base: dict | None, key: str) -> str:
    return f"{row[key] / base[key]:.2f}" if base and base[key] else "-"


def print_tables(console: Console, rows: list[dict], title: str) -> None:
    table = Table(title=title)
    for column in ("arm", "at once", "prompts", "TTFT p50 ms", "p99", "ITL p50 ms", "p99",
                   "out tok/s", "TTFT p50 x col", "ITL p50 x col", "tok/s x col", "failed"):
        table.add_column(column, justify="right")
    for r in rows:
        base = next((b for b in rows if b["arm"] == "colocated"
                     and b["concurrency"] == r["concurrency"]), None)
        table.add_row(r["arm"], str(r["concurrency"]), str(r["prompts"]), f"{r['ttft_p50']:.1f}",
                      f"{r['ttft_p99']:.1f}", f"{r['itl_p50']:.1f}", f"{r['itl_p99']:.1f}",
                      f"{r['output_throughput']:.1f}", ratio(r, base, "ttft_p50"),
                      ratio(r, base, "itl_p50"), ratio(r, base, "output_throughput"),
                      str(r["failed"]))
    console.print(table)
    consumer = Table(title="the split's consumer (the client's test request included)")
    for column in ("at once", "requests", "hand-offs waited", "incomplete", "tokens recomputed",
                   "prompt tokens", "from kvtier", "its mean TTFT ms"):
        consumer.add_column(column, justify="right")
    for r in (r for r in rows if r["arm"] == "split"):
        e = r["engines"][1]
        count = e["vllm:time_to_first_token_seconds_count"]
        consumer.add_row(str(r["concurrency"]), f"{e['vllm:request_success_total']:.0f}",
                         *[f"{e[name]:.0f}" for name in HANDOFF],
                         f"{e['vllm:prompt_tokens_total']:.0f}",
                         f"{e['vllm:external_prefix_cache_hits_total']:.0f}",
                         f"{1000 * e['vllm:time_to_first_token_seconds_sum'] / count:.1f}"
                         if count else "-")
    console.print(consumer)


def level_pairs(text: str) -> list[tuple[int, int]]:
    pairs = [tuple(int(n) for n in item.split(":")) for item in text.split(",") if item.strip()]
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: want CONCURRENCY:PROMPTS[,...]")
    return pairs  # type: ignore[return-value]


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "mid"], default="tiny")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {','.join(ARMS)}")
    parser.add_argument("--levels", type=level_pairs, default=level_pairs("1:8,4:16,16:32"),
                        help="CONCURRENCY:PROMPTS, comma-separated (default 1:8,4:16,16:32)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one level's load")
    parser.add_argument("--dir", type=Path, help="where the pool directories go (default: a "
                                                 "temporary directory on the root disk)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    args.arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    if unknown := sorted(set(args.arms) - set(ARMS)):
        parser.error(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    if args.prompt_tokens <= SUFFIX:
        parser.error(f"--prompt-tokens: more than {SUFFIX}")
    return args


def main() -> None:
    args = arguments()
    console = Console(width=200)
    model = word_model(make_model(ROOT / "out" / "models" / args.model, args.model))
    rows, started = [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvtier-pd-", dir=args.dir) as tmp:
        for level in args.levels:
            for arm in args.arms:
                work = Path(tmp) / f"{arm}-{level[0]}"
                try:
                    rows.append(run_level(arm, args, model, work, level, console))
                except Exception:
                    log_tails(work, console)
                    raise
    title = (f"{args.prompt_tokens}-token prompts, {args.output_tokens} tokens out, "
             f"{args.model} model, two engines one core each (ratios to colocated, same run; "
             f"{time.monotonic() - started:.0f} s)")
    print_tables(console, rows, title)
    save(args.json, {"args": vars(args), "rows": rows})


def save(path: Path | None, results: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
