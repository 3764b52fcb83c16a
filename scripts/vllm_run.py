"""Run prompts through a real vLLM engine (CPU build), with or without a KV connector.

    python scripts/vllm_run.py SPEC.json OUT.json

SPEC: {"model": DIR, "connector": "kvtier" | "example" | "lmcache" | null, "extra": {...},
       "dtype": "float32", "prefix_caching": false, "max_model_len": 9216,
       "num_gpu_blocks": null (vLLM's own KV cache size, in blocks; null: from kv_cache_gib),
       "phases": [{"prompts": [[token ids], ...], "max_tokens": 8, "together": false,
                   "salt": null}, ...]}

Each phase runs its prompts one at a time (``together: false``, timing each: with
``max_tokens: 1`` the time is the time to first token) or all in one batch. OUT gets, per
phase and prompt, the generated token ids, vLLM's cached-token count and the seconds taken,
plus kvtier's scheduler-side counters and vLLM's KV cache groups when the engine runs in this
process, and the metrics kvtier serves when the extra config sets ``metrics_port``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def connector_config(spec: dict) -> dict | None:
    kind = spec.get("connector")
    if kind == "kvtier":
        return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
                "kv_role": "kv_both", "kv_connector_extra_config": spec.get("extra", {})}
    if kind == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": spec["extra"]["path"]}}
    if kind == "lmcache":  # LMCacheMPConnector; extra: its lmcache.mp.* keys (scripts/peers/lmcache.py)
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": spec.get("extra", {})}
    return None


def kvtier_counters(llm) -> dict | None:
    """kvtier's scheduler-side counters (engine core in this process only)."""
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        return dict(scheduler.connector._scheduler.counters)
    except AttributeError:
        return None


def kv_cache_groups(llm) -> list[str] | None:
    """The kinds of vLLM's KV cache groups (engine core in this process only): more than one
    when the hybrid KV cache manager is on for a hybrid model."""
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        return [type(g.kv_cache_spec).__name__ for g in scheduler.kv_cache_config.kv_cache_groups]
    except AttributeError:
        return None


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if connector_config(spec) is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**connector_config(spec))
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
              dtype=spec.get("dtype", "bfloat16"), max_model_len=spec.get("max_model_len", 9216),
              enable_prefix_caching=spec.get("prefix_caching", False),
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 16384),
              tensor_parallel_size=spec.get("tensor_parallel_size", 1),
              num_gpu_blocks_override=spec.get("num_gpu_blocks"), seed=0, **kwargs)
    out = {"phases": []}
    for phase in spec["phases"]:
        params = SamplingParams(max_tokens=phase.get("max_tokens", 8), temperature=0.0,
                                ignore_eos=True, detokenize=False)
        salt = {"cache_salt": phase["salt"]} if phase.get("salt") else {}
        prompts = [TokensPrompt(prompt_token_ids=p, **salt) for p in phase["prompts"]]
        results = []
        if phase.get("together"):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = [time.perf_counter() - start] * len(outputs)
        else:
            outputs, seconds = [], []
            for prompt in prompts:
                start = time.perf_counter()
                outputs += llm.generate([prompt], params, use_tqdm=False)
                seconds.append(time.perf_counter() - start)
        for output, elapsed in zip(outputs, seconds, strict=True):
            results.append({"tokens": list(output.outputs[0].token_ids),
                            "cached": output.num_cached_tokens or 0, "seconds": elapsed})
        out["phases"].append(results)
    out["kvtier"] = kvtier_counters(llm)
    out["kv_cache_groups"] = kv_cache_groups(llm)
    port = spec.get("extra", {}).get("metrics_port")
    if port:  # what kvtier's scheduler side and worker 0 serve, read while the engine is up
        from kvtier.cli.stats import read_metrics

        out["metrics"] = {"scheduler": read_metrics(f"127.0.0.1:{port}"),
                          "worker": read_metrics(f"127.0.0.1:{port + 1}")}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    del llm


if __name__ == "__main__":
    main()
