"""The model settings that change a chunk's KV bytes without changing its shape.

Two engines of one model, one KV dtype and one page shape still compute other K and V for
the same tokens when they run the model differently: rotary embeddings scaled otherwise
(``rope_scaling``, ``rope_theta``; Phi-3's LongRoPE picks its factors by ``max_model_len``),
weights quantized online (``quantization``), another activation dtype under an fp8 KV cache,
a config overridden (``hf_overrides``), another snapshot of a hub model, another draft model
for speculative decoding, and on CPUs the instruction set attention writes pages with.
``settings_digest`` names them all, so that such engines keep their chunks apart
(``Namespace.model_settings``) and never load each other's.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

# the model config's fields (``hf_config``) that rotary embeddings read
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # an object's address in its default text
ROPE_FIELDS = ("rope_scaling", "rope_theta", "rope_parameters", "partial_rotary_factor",
               "max_position_embeddings", "original_max_position_embeddings")


def model_settings(vllm_config: Any) -> dict[str, Any]:
    """What the digest covers, read from vLLM's config (a field it lacks is left out)."""
    model = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model, "hf_config", None)
    found = {name: getattr(model, name, None)
             for name in ("max_model_len", "quantization", "dtype", "hf_overrides")}
    found["snapshot"] = getattr(hf_config, "_commit_hash", None)  # a hub model's, resolved
    found.update({name: getattr(hf_config, name, None) for name in ROPE_FIELDS})
    speculative = getattr(vllm_config, "speculative_config", None)
    draft = getattr(speculative, "draft_model_config", None)
    found["draft"] = getattr(draft, "model", None) or getattr(speculative, "model", None)
    found["cpu_attention"] = cpu_attention_isa(vllm_config)
    return {name: value for name, value in found.items() if value not in (None, {}, "")}


def cpu_attention_isa(vllm_config: Any) -> str | None:
    """On vLLM's CPU platform, the instruction set its attention writes pages with (``amx``,
    ``vec``, ``vec16``, ``neon``...: each may lay a page out its own way, and hosts differ);
    None elsewhere, or where vLLM does not say."""
    try:
        model, cache = vllm_config.model_config, vllm_config.cache_config
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(model.dtype, cache.block_size, model.get_head_size(),
                                 str(cache.cache_dtype)))
    except Exception:  # no vLLM, another version's names, a config of the tests' own
        return None


def settings_digest(vllm_config: Any) -> str:
    """A digest (hex) of ``model_settings``: the same for engines that compute the same KV."""
    text = json.dumps(model_settings(vllm_config), sort_keys=True, default=_plain)
    return hashlib.blake2b(text.encode(), digest_size=8, person=b"kvtier-model").hexdigest()


def _plain(value: Any) -> str:
    """``value`` as text that is the same in every process: a function (``hf_overrides`` may
    be one) by its name, never by its address."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return _ADDRESS.sub("", str(value))
