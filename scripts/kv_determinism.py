"""How far a prompt's KV moves when vLLM computes it in another batch shape: what a check of
a cache hit against a fresh computation must tolerate on this engine.

    python scripts/kv_determinism.py [--dir out/kv_determinism] [--tokens 1536]

Each arm runs a fresh engine (scripts/vllm_run.py; the tiny generated model, float32) with
kvtier writing every chunk through to a directory of its own, and computes prompt P once:
alone; in one batch with two other prompts; after a prompt sharing its first 1,024 tokens
(vLLM's prefix cache on, so P's later tokens attend to cached ones); with chunked prefill
of 512 tokens a step. Then each chunk of P is read back from each arm's directory and
compared with the one computed alone: the largest difference, relative to the chunk's
largest value and to the largest value of its layer's K or V (the scale of the sampled
checks' ``verify_tolerance``), and the share of values that differ. Another prompt's
chunk differs by the values' own size; a tolerance between the two tells them apart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from kvtier.io.format import HEADER_BYTES, decode_header  # noqa: E402

BLOCK, KV_HEADS, HEAD_SIZE = 128, 2, 64  # the tiny model on vLLM's CPU build
KV_RUN = BLOCK * HEAD_SIZE  # values of a head's tokens' K, then of their V (page_values)
PAGE_VALUES = KV_HEADS * 2 * KV_RUN


def arms(tokens: int) -> dict[str, tuple[list[dict], dict]]:
    """Each arm's phases and engine settings."""
    rng = np.random.default_rng(7)
    p = rng.integers(100, 30000, tokens).tolist()
    q, r = rng.integers(100, 30000, 2048).tolist(), rng.integers(100, 30000, 700).tolist()
    shared = p[:1024] + rng.integers(100, 30000, 300).tolist()

    def phase(prompts: list, together: bool = False) -> dict:
        return {"prompts": prompts, "together": together, "max_tokens": 1}

    return {"alone": ([phase([p])], {}),
            "batched": ([phase([q, p, r], together=True)], {}),
            "after_prefix_hit": ([phase([shared]), phase([p])], {"prefix_caching": True}),
            "chunked_prefill": ([phase([p])], {"max_num_batched_tokens": 512})}


def run_arm(work: Path, model: Path, name: str, phases: list[dict], engine: dict) -> None:
    disk = work / name
    disk.mkdir(parents=True, exist_ok=True)
    spec = {"model": str(model), "connector": "kvtier", "dtype": "float32",
            "extra": {"chunk_tokens": 256, "host_capacity": "64MiB", "disk_paths": [str(disk)],
                      "disk_capacity": "256MiB", "load_policy": "always"},
            "phases": phases, **engine}
    (work / f"{name}.json").write_text(json.dumps(spec))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_run.py"), str(work / f"{name}.json"),
                    str(work / f"{name}.out.json")], check=True, timeout=900,
                   env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, capture_output=True)


def chunks(root: Path) -> dict[bytes, np.ndarray]:
    """Every chunk written under ``root``, by key (float32 values)."""
    found: dict[bytes, np.ndarray] = {}
    for path in root.rglob("*"):
        if not path.is_file() or path.stat().st_size < 2 * HEADER_BYTES:
            continue
        data, at = path.read_bytes(), 0
        while at + HEADER_BYTES <= len(data):
            try:
                header = decode_header(data[at:at + HEADER_BYTES])
            except ValueError:  # a blank or torn slot, or not a slot
                at += HEADER_BYTES
                continue
            start = at + HEADER_BYTES
            found[bytes(header.key)] = np.frombuffer(data[start:start + header.payload_bytes],
                                                     np.float32)
            at = start + -(-header.payload_bytes // 4096) * 4096
    return found


def parts(values: np.ndarray) -> np.ndarray:
    """A chunk's values as the sampled checks scale them (``tolerance.kv_parts``): each
    page's K, then its V, one row each (the tiny model's page on the CPU: a head's tokens'
    K, then their V)."""
    runs = values.reshape(-1, PAGE_VALUES // (2 * KV_RUN), 2, KV_RUN)
    return runs.transpose(0, 2, 1, 3).reshape(-1, PAGE_VALUES // 2)


def compare(work: Path, names: list[str]) -> list[dict]:
    base = chunks(work / "alone")
    rows = []
    for name in names:
        other = chunks(work / name)
        for index, (key, values) in enumerate(base.items()):
            if key not in other:
                continue
            diff = np.abs(values.astype(np.float64) - other[key].astype(np.float64))
            scale = np.abs(parts(values)).max(axis=1, keepdims=True)  # the checks' scale
            rows.append({"arm": name, "chunk": index,
                         "max_rel_diff": float(diff.max() / np.abs(values).max()),
                         "max_part_diff": float((parts(diff) / scale).max()),
                         "share_differing": float(np.count_nonzero(diff) / diff.size)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="out/kv_determinism")
    parser.add_argument("--tokens", type=int, default=1536)
    args = parser.parse_args()
    from make_model import make_model

    work = Path(args.dir).resolve()
    model = make_model(work / "tiny", "tiny")
    plan = arms(args.tokens)
    for name, (phases, engine) in plan.items():
        run_arm(work, model, name, phases, engine)
    for row in compare(work, list(plan)):
        print(f"{row['arm']:>17} chunk {row['chunk']}: max difference {row['max_rel_diff']:.2g} "
              f"of the largest value ({row['max_part_diff']:.2g} of its layer's K or V, as "
              f"verify_tolerance counts), {row['share_differing']:.0%} of values differ")


if __name__ == "__main__":
    main()
