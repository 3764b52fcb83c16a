"""What vllm-router's pre-pass costs a text prompt under ``kv_aware``: the time of one
``/v1/completions/render`` (the prompt's token ids, which the router asks every engine for)
against a completion of one token whose prompt is a whole GPU-cache hit, on one engine of
``scripts/bench_router.py``'s setup (tiny model, word-level tokenizer, pinned to one core).

    python scripts/bench_render.py                  # a prompt of 4,160 tokens, 20 of each
    python scripts/bench_render.py --tokens 1024 --repeats 50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_router import word_model  # noqa: E402
from make_model import make_model  # noqa: E402

from tests.helpers.router_fleet import SERVED, EngineConfig, Fleet  # noqa: E402


def post(url: str, body: dict) -> float:
    """Seconds for one POST of ``body`` to ``url``, its answer read whole."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as answer:
        answer.read()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4160, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=20, help="calls of each kind")
    args = parser.parse_args()
    model = word_model(make_model(ROOT / "out" / "models" / "tiny", "tiny"))
    blocks = args.tokens // 128 + 4
    with tempfile.TemporaryDirectory(prefix="kvtier-render-") as tmp, \
            Fleet(Path(tmp), dict(os.environ)) as fleet:
        (engine,) = fleet.start_engines([EngineConfig(
            model, {"chunk_tokens": 256, "host_capacity": "64MiB"}, blocks, cpu=0)])
        text = " ".join(f"w{i % 900 + 10}" for i in range(args.tokens))
        completion = {"model": SERVED, "prompt": text, "max_tokens": 1}
        post(f"{engine.url}/v1/completions", completion)  # computed once: hits from here on
        render = [post(f"{engine.url}/v1/completions/render", {"model": SERVED, "prompt": text})
                  for _ in range(args.repeats)]
        hit = [post(f"{engine.url}/v1/completions", completion) for _ in range(args.repeats)]
    for name, times in (("render", render), ("completion, a whole GPU hit", hit)):
        print(f"{name}: p50 {statistics.median(times) * 1e3:.1f} ms, "
              f"max {max(times) * 1e3:.1f} ms ({args.repeats} calls, {args.tokens} tokens)")


if __name__ == "__main__":
    main()
