"""vLLM's KV cache specs and configs for geometry tests (vLLM imported when first used)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvtier.config.settings import load_config

BLOCK, CHUNK = 16, 32
CONFIG = load_config({"chunk_tokens": CHUNK, "host_capacity": "4MiB"}, environ={})


def _specs():
    from vllm.v1 import kv_cache_interface

    return kv_cache_interface


def full(**kw):
    return _specs().FullAttentionSpec(block_size=kw.get("block", BLOCK), num_kv_heads=2,
                                      head_size=kw.get("head", 64), dtype=torch.bfloat16)


def sliding(window=64, **kw):
    return _specs().SlidingWindowSpec(block_size=kw.get("block", BLOCK), num_kv_heads=2,
                                      head_size=kw.get("head", 64), dtype=torch.bfloat16,
                                      sliding_window=window)


def vllm_configs(*specs, pp=1, cache_dtype="auto", dcp=1, pcp=1):
    groups = [_specs().KVCacheGroupSpec([f"layers.{g}.{i}" for i in range(2)], s)
              for g, s in enumerate(specs)]
    parallel = SimpleNamespace(pipeline_parallel_size=pp, decode_context_parallel_size=dcp,
                               prefill_context_parallel_size=pcp)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="tiny-gemma"),
                                  parallel_config=parallel,
                                  cache_config=SimpleNamespace(cache_dtype=cache_dtype))
    return vllm_config, SimpleNamespace(kv_cache_groups=groups)
