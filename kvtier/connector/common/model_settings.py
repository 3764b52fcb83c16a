"""The model settings that change a chunk's KV bytes without changing its shape.

Two engines of one model (path and revision), one KV dtype and one page shape still compute
other K and V for the same tokens when they run the model differently: another config file
(a local model's ``config.json`` edited, or ``hf_config_path``), other weights under one
local path (``weights_digest``: sampled, so a change between the samples is not seen), a
config overridden (``hf_overrides``: rope scaling, say) or another model class
(``model_class_overrides``), weights quantized online (``quantization``), another activation
dtype under an fp8 KV cache (``dtype``), Phi-3's LongRoPE on its long factors
(``max_model_len`` past the model's ``original_max_position_embeddings``), another draft
model for speculative decoding (or its weights), and on CPUs the instruction set attention
writes pages with. ``settings_digest`` names them all,
so that such engines keep their chunks apart (``Namespace.model_settings``) and never load
each other's.

Only what every process of one engine reads alike is digested: the scheduler and each
worker compute it apart, and a worker's model code may rewrite its ``hf_config`` as it
builds the model (DeepSeek's rope parameters), so the loaded ``hf_config`` is read for the
LongRoPE switch only, and a local model's config as its file holds it. A hub model's
snapshot is named by ``revision`` (the namespace has it): pin it, or a new snapshot under
one name shares the namespace.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import re
from typing import Any

from kvtier.connector.common.weights_digest import weights_digest

log = logging.getLogger("kvtier")
CONFIG_FILE, CONFIG_BYTES = "config.json", 4 * 1024 * 1024  # a model's config, read at most
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # an object's address in its default text
_USER_FIELDS = ("quantization", "dtype", "hf_overrides", "model_class_overrides")


def model_settings(vllm_config: Any, kv_cache_config: Any = None) -> dict[str, Any]:
    """What the digest covers, read from vLLM's config (a field it lacks is left out)."""
    model = getattr(vllm_config, "model_config", None)
    found = {name: getattr(model, name, None) for name in _USER_FIELDS}
    found["config_file"] = config_file_digest(model)
    found["weights"] = _local_weights(getattr(model, "model", None))
    found["long_rope"] = long_rope(model) or None
    speculative = getattr(vllm_config, "speculative_config", None)
    draft = getattr(getattr(speculative, "draft_model_config", None), "model", None)
    if draft != getattr(model, "model", None):  # a model of its own (not n-gram, not MTP)
        found["draft"] = draft
        found["draft_weights"] = _local_weights(draft)
    found["cpu_attention"] = cpu_attention_isa(vllm_config, kv_cache_config)
    return {name: value for name, value in found.items() if value not in (None, {}, "")}


def config_file_digest(model: Any) -> str | None:
    """A digest of the model's ``config.json`` as the files hold it (before any process's
    model code touches it: the same in every process), where the model, or
    ``hf_config_path``, is a local directory: a config edited in place, or another one
    given, changes it. None for a hub model (its ``revision`` names it)."""
    where = getattr(model, "hf_config_path", None) or getattr(model, "model", None)
    if not isinstance(where, str) or not os.path.isdir(where):
        return None
    data = config_bytes(where, CONFIG_FILE)
    return None if data is None else hashlib.blake2b(data, digest_size=8).hexdigest()


def config_bytes(where: str, name: str) -> bytes | None:
    """The first ``CONFIG_BYTES`` of file ``name`` in directory ``where``, a model's or an
    adapter's own (vLLM read the file already), not a cache root; None when unreadable."""
    try:
        with open(os.path.join(where, name), "rb") as file:
            return file.read(CONFIG_BYTES)
    except OSError:
        return None


def _local_weights(where: Any) -> str | None:
    """``weights_digest`` of a local model (a directory, or one file); None for a hub
    model's name."""
    return weights_digest(where) if isinstance(where, str) and os.path.exists(where) else None


def long_rope(model: Any) -> bool:
    """Whether Phi-3's LongRoPE runs on its long factors: its rope type is ``longrope`` and
    ``max_model_len`` passes ``original_max_position_embeddings`` (of the language model's
    config, in its rope parameters where they hold it)."""
    hf_config = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    rope = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None)
    rope = rope if isinstance(rope, dict) else {}
    kind = rope.get("rope_type", rope.get("type"))
    original = rope.get("original_max_position_embeddings",  # where vLLM reads it
                        getattr(hf_config, "original_max_position_embeddings", None))
    length = getattr(model, "max_model_len", None)
    return kind == "longrope" and isinstance(original, int) and isinstance(length, int) \
        and length > original


def cpu_attention_isa(vllm_config: Any, kv_cache_config: Any = None) -> str | None:
    """On vLLM's CPU platform, the instruction set its attention writes pages with (``amx``,
    ``vec``, ``vec16``, ``neon``...: each may lay a page out its own way, and hosts differ),
    for the KV cache's own block size and head size; None elsewhere, or where vLLM does not
    say (logged)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # no vLLM: a configuration of the tests' own
        return None
    try:
        if not current_platform.is_cpu():
            return None
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model, cache = vllm_config.model_config, vllm_config.cache_config
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        spec = groups[0].kv_cache_spec if groups else None
        spec = getattr(spec, "first_spec", None) or spec  # a worker's: layers of one type
        block = getattr(spec, "block_size", None) or cache.block_size
        head = getattr(spec, "head_size", None) or model.get_head_size()
        return str(_get_attn_isa(model.dtype, block, head, str(cache.cache_dtype)))
    except Exception as exc:  # another version's names, a configuration of the tests' own
        log.debug("kvtier: the CPU attention's instruction set is not known (%r)", exc)
        return None


def settings_digest(vllm_config: Any, kv_cache_config: Any = None) -> str:
    """A digest (hex) of ``model_settings``: the same for engines that compute the same KV."""
    text = json.dumps(_plain(model_settings(vllm_config, kv_cache_config)), sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=8, person=b"kvtier-model").hexdigest()


def _plain(value: Any) -> Any:
    """``value`` in JSON's terms, the same in every process: mappings with text keys, sets
    in order, a function (``hf_overrides`` may be one) by its name and its source, never by
    its address."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, set | frozenset):
        return sorted(json.dumps(_plain(item), sort_keys=True) for item in value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if callable(value) and hasattr(value, "__qualname__"):
        try:
            source = inspect.getsource(value)
        except (OSError, TypeError):
            source = ""
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}:{source}"
    return _ADDRESS.sub("", str(value))
