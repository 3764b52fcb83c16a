"""Run prompts through a real vLLM engine (CPU build), with or without a KV connector.

    python scripts/vllm_run.py SPEC.json OUT.json
    python scripts/vllm_run.py --serve       # one run per line of stdin: "SPEC.json OUT.json"

SPEC: {"model": DIR, "connector": "kvtier" | "example" | "lmcache" | null, "extra": {...},
       "dtype": "float32", "prefix_caching": false, "max_model_len": 9216,
       "num_gpu_blocks": null (vLLM's own KV cache size, in blocks; null: from kv_cache_gib),
       "kv_events_config": null (vLLM's KVEventsConfig: its KV events published, e.g. on ZMQ),
       "phases": [{"prompts": [[token ids], ...], "max_tokens": 8, "together": false,
                   "salt": null, "mark": null, "until": null, "max_repeats": 1}, ...]}

Each phase runs its prompts one at a time (``together: false``, timing each: with
``max_tokens: 1`` the time is the time to first token) or all in one batch. OUT gets, per
phase and prompt, the generated token ids, vLLM's cached-token count, the seconds taken and
the wall-clock start and end,
plus kvtier's scheduler-side counters and vLLM's KV cache groups when the engine runs in this
process, and the metrics kvtier serves when the extra config sets ``metrics_port``.

For engines run side by side (tests, scripts/fleet.py): a phase with ``barrier`` ({"dir": D,
"name": N, "count": K}) starts once K engines reached it (each leaves ``D/<phase>.<N>``),
then after ``sleep`` seconds; with ``mark`` it creates that file when it starts; with
``until`` ({"exists": PATH} or {"gone": PATH}) it runs again and again until that holds, at
most ``max_repeats`` times (its results are the runs' results in order, each with its
``repeat``). A phase with ``watch`` (token lists) runs nothing: it polls until kvtier's
scheduler side sees every chunk of each list in another engine's segment, at most
``timeout`` seconds, and gives the wall-clock time each became visible (null: never). A
phase with ``reset_cache`` first resets vLLM's caches and the connector's
(``reset_prefix_cache(reset_connector=True)``, as a weight update in place does); with
``reset_prefix``, vLLM's prefix cache alone (``reset_prefix_cache()``).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time


def connector_config(spec: dict) -> dict | None:
    kind = spec.get("connector")
    if kind == "kvtier":  # or a subclass of it: spec "connector_class" ("module:Class")
        module, name = spec.get("connector_class", "kvtier.connector:KVTierConnector").split(":")
        return {"kv_connector": name, "kv_connector_module_path": module,
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


def done(until: dict | None) -> bool:
    if until is None:
        return False
    if "exists" in until:
        return os.path.exists(until["exists"])
    return not os.path.exists(until["gone"])


def wait_barrier(barrier: dict, index: int) -> None:
    """Arrive at phase ``index``'s barrier and wait (bounded) for the others."""
    directory = barrier["dir"]
    open(os.path.join(directory, f"{index}.{barrier['name']}"), "w").close()
    deadline = time.monotonic() + barrier.get("timeout", 900)
    while sum(name.startswith(f"{index}.") for name in os.listdir(directory)) < barrier["count"]:
        if time.monotonic() > deadline:
            raise SystemExit(f"barrier of phase {index} in {directory}: the other engines "
                             "never came")
        time.sleep(0.005)


def watch_visible(llm, watched: list[list[int]], timeout: float) -> list[dict]:
    """When kvtier's scheduler side (engine core in this process) first saw every chunk of
    each token list in another engine's segment."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    core = llm.llm_engine.engine_core.engine_core
    side = core.scheduler.connector._scheduler
    if side.others is None:
        raise SystemExit("watch: kvtier follows no other engine here (disk_paths and "
                         "share_refresh must be set)")
    keys = []
    for i, tokens in enumerate(watched):
        request = Request(f"watch-{i}", tokens, SamplingParams(max_tokens=1), None,
                          block_hasher=core.request_block_hasher)
        keys.append(side.chunk_keys(request, len(tokens) // side.geometry.chunk_tokens))
    seen: list[float | None] = [None] * len(watched)
    deadline = time.monotonic() + timeout
    while None in seen and time.monotonic() < deadline:
        for i, chunk_keys in enumerate(keys):
            if seen[i] is None and all(side.others.find(k) is not None for k in chunk_keys):
                seen[i] = time.time()
        time.sleep(0.002)
    return [{"visible_at": at, "chunks": len(k)} for at, k in zip(seen, keys, strict=True)]


def run_phase(llm, phase: dict, repeat: int) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=phase.get("max_tokens", 8), temperature=0.0,
                            ignore_eos=True, detokenize=False)
    salt = {"cache_salt": phase["salt"]} if phase.get("salt") else {}
    prompts = [TokensPrompt(prompt_token_ids=p, **salt) for p in phase["prompts"]]
    outputs, seconds, spans = [], [], []
    if phase.get("together"):
        start, began = time.perf_counter(), time.time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = [time.perf_counter() - start] * len(outputs)
        spans = [(began, time.time())] * len(outputs)
    else:
        for prompt in prompts:
            start, began = time.perf_counter(), time.time()
            outputs += llm.generate([prompt], params, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
            spans.append((began, time.time()))
    return [{"tokens": list(output.outputs[0].token_ids), "cached": output.num_cached_tokens or 0,
             "seconds": elapsed, "start": span[0], "end": span[1], "repeat": repeat}
            for output, elapsed, span in zip(outputs, seconds, spans, strict=True)]


def run_spec(spec: dict) -> dict:
    """Run ``spec`` in this process: its engine made, its phases run, the engine shut down."""
    from vllm import LLM

    kwargs = {}
    if connector_config(spec) is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**connector_config(spec))
    if spec.get("kv_events_config"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events_config"])
    if spec.get("attention_backend"):  # e.g. CPU_MLA: the same on every x86 CPU, AMX or not
        kwargs["attention_backend"] = spec["attention_backend"]
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
              dtype=spec.get("dtype", "bfloat16"), max_model_len=spec.get("max_model_len", 9216),
              enable_prefix_caching=spec.get("prefix_caching", False),
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 16384),
              tensor_parallel_size=spec.get("tensor_parallel_size", 1),
              num_gpu_blocks_override=spec.get("num_gpu_blocks"), seed=0, **kwargs)
    try:
        return run_phases(llm, spec)
    finally:
        llm.llm_engine.engine_core.shutdown()  # kvtier's connector closes with the engine
        del llm
        gc.collect()


def run_phases(llm, spec: dict) -> dict:
    out: dict = {"phases": []}
    for index, phase in enumerate(spec["phases"]):
        if phase.get("barrier"):
            wait_barrier(phase["barrier"], index)
        time.sleep(phase.get("sleep", 0))
        if phase.get("mark"):
            open(phase["mark"], "w").close()
        if phase.get("reset_cache") and not llm.reset_prefix_cache(reset_connector=True):
            raise SystemExit("vLLM's cache reset (reset_connector) failed")
        if phase.get("reset_prefix") and not llm.reset_prefix_cache():
            raise SystemExit("vLLM's prefix cache reset failed")
        if phase.get("watch") is not None:
            out["phases"].append(watch_visible(llm, phase["watch"], phase.get("timeout", 60)))
            continue
        results = []
        for repeat in range(phase.get("max_repeats", 1)):
            results += run_phase(llm, phase, repeat)
            if done(phase.get("until")):
                break
        out["phases"].append(results)
    out["kvtier"] = kvtier_counters(llm)
    out["kv_cache_groups"] = kv_cache_groups(llm)
    port = spec.get("extra", {}).get("metrics_port")
    if port:  # what kvtier's scheduler side and worker 0 serve, read while the engine is up
        from kvtier.cli.stats import read_metrics

        out["metrics"] = {"scheduler": read_metrics(f"127.0.0.1:{port}"),
                          "worker": read_metrics(f"127.0.0.1:{port + 1}")}
    return out


def write_json(path: str, value: dict) -> None:
    write_text(path, json.dumps(value))


def write_text(path: str, text: str) -> None:
    """``path`` holding ``text``, whole or not at all: whoever waits for it never reads it
    half written."""
    with open(path + ".part", "w") as f:
        f.write(text)
    os.replace(path + ".part", path)


def serve() -> None:
    """Run spec after spec in this one process, vLLM imported once (the tests' warm engine
    host, ``tests/helpers/vllm_engine.py``). Each line of standard input names ``SPEC OUT``; the run
    writes OUT, then ``OUT.done`` holding ``ok`` or the failure. A failed run ends the
    process, so that no engine's leftovers reach the next run."""
    import vllm.envs

    for line in sys.stdin:
        spec_path, out_path = line.split()
        try:
            with open(spec_path) as f:
                spec = json.load(f)
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec.get("kv_cache_gib", 1))
            write_json(out_path, run_spec(spec))
        except BaseException:
            import traceback

            write_text(out_path + ".done", traceback.format_exc())
            raise
        finally:
            vllm.envs.disable_envs_cache()  # vLLM reads its variables afresh for the next run
        write_text(out_path + ".done", "ok")


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        serve()
        return
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    write_json(sys.argv[2], run_spec(spec))


if __name__ == "__main__":
    main()
