"""What sampled checks (``verify_sample``) cost a RAG load, and whether they ever call a right
chunk wrong.

    python scripts/bench_verify.py                 # the cost: rates 0, 1/1000 and 1/50
    python scripts/bench_verify.py --false-alarms  # 1,000+ sampled hits at rate 1: none wrong

The load is scripts/workload.py's RAG pattern (``--docs`` documents of ``--doc-tokens``
tokens, each request one document and a new question; a first round computes every
document, then ``--rounds`` rounds of ``--batch`` requests sent together). vLLM's prefix
cache is off, so every repeat of a document is a kvtier hit from host memory: the most a
sampled check can cost against a hit. Each rate runs ``--repeats`` times, the rates taking
turns in one engine process (vLLM imported once), and the median of each rate's timed
seconds is compared with rate 0's in the same run. A sampled request costs one prefill of
its prompt where a hit would have loaded it, and one comparison per chunk on a worker
thread: at rate r the expected cost is about r times (prefill / hit) of a request's time.

``--false-alarms``: rate 1 (every hit is computed and its chunks checked) over the same load
in batches, where vLLM's CPU build computes KV a few units in the last place apart from the
batch shape that stored it; exits 1 if any check found a mismatch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from engine_host import EngineHost  # noqa: E402
from make_model import make_model  # noqa: E402
from ttft import engine_env  # noqa: E402
from workload import rag_load  # noqa: E402

RATES = {"0": 0.0, "1/1000": 0.001, "1/50": 0.02}
ENGINE_TIMEOUT_S = 3600.0

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--docs", type=int, default=16)
parser.add_argument("--doc-tokens", type=int, default=1024)
parser.add_argument("--question-tokens", type=int, default=32)
parser.add_argument("--max-tokens", type=int, default=4)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--rounds", type=int, default=64)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--rates", default=",".join(RATES), help=f"of {','.join(RATES)}")
parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
parser.add_argument("--false-alarms", action="store_true",
                    help="rate 1 over the load: count mismatches (there must be none)")
parser.add_argument("--json", type=Path, help="write the results here")


def engine_spec(model: Path, phases: list[dict], length: int, rate: float, dtype: str) -> dict:
    extra = {"chunk_tokens": 256, "host_capacity": "2GiB", "load_policy": "always",
             "verify_sample": rate}
    return {"model": str(model), "dtype": dtype, "prefix_caching": False,
            "max_model_len": length + 64, "max_num_batched_tokens": 16384, "connector": "kvtier",
            "extra": extra, "phases": phases}


def timed(out: dict) -> tuple[float, int]:
    """(seconds of the timed rounds, requests among them)."""
    rounds = out["phases"][1:]
    return sum(r[0]["seconds"] for r in rounds), sum(len(r) for r in rounds)


def main() -> None:
    args = parser.parse_args()
    warm, rounds, length, _ = rag_load(args, np.random.default_rng(0))
    model = make_model(ROOT / "out" / "models" / "tiny", "tiny")
    console = Console()
    rates = {"1": 1.0} if args.false_alarms else {
        name: RATES[name] for name in args.rates.split(",") if name}
    results: dict[str, list[dict]] = {name: [] for name in rates}
    with tempfile.TemporaryDirectory(prefix="kvtier-verify-") as tmp, \
            EngineHost(engine_env("all")) as host:
        for repeat in range(1 if args.false_alarms else args.repeats):
            for name, rate in rates.items():
                out = host.run(engine_spec(model, warm + rounds, length, rate, args.dtype), Path(tmp),
                               f"{name.replace('/', 'in')}-{repeat}", ENGINE_TIMEOUT_S)
                seconds, requests = timed(out)
                counters = out["kvtier"] or {}
                results[name].append({"seconds": seconds, "requests": requests, **{
                    key: counters.get(key, 0) for key in (
                        "verify_sampled_requests", "chunks_verified", "load_chunks_host")},
                    "mismatches": sum(v for k, v in counters.items()
                                      if k.startswith("verify_mismatches_"))})
                console.print(f"[dim]rate {name}, run {repeat + 1}: {seconds:.2f} s, "
                              f"{results[name][-1]}[/dim]")
    report(args, results, console)


def report(args, results: dict[str, list[dict]], console: Console) -> None:
    table = Table(title=f"RAG: {args.rounds} rounds of {args.batch} requests on {args.docs} "
                        f"documents of {args.doc_tokens} tokens, tiny model, {args.dtype} (one run)")
    for column in ("verify_sample", "median s", "x rate 0", "requests sampled", "chunks checked",
                   "mismatches"):
        table.add_column(column, justify="right")
    base = statistics.median(r["seconds"] for r in results.get("0", results[next(iter(results))]))
    rows = {}
    for name, runs in results.items():
        median = statistics.median(r["seconds"] for r in runs)
        rows[name] = {"median_s": median, "vs_rate_0": median / base, "runs": runs}
        table.add_row(name, f"{median:.2f}", f"{median / base:.3f}",
                      str(sum(r["verify_sampled_requests"] for r in runs)),
                      str(sum(r["chunks_verified"] for r in runs)),
                      str(sum(r["mismatches"] for r in runs)))
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {**vars(args), "json": str(args.json)},
                                         "rates": rows}, indent=2))
    if sum(r["mismatches"] for runs in results.values() for r in runs):
        console.print("[red]a right chunk was called wrong[/red]")
        sys.exit(1)


if __name__ == "__main__":
    main()
