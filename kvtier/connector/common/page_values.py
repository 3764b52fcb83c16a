"""What the values in a page of vLLM's KV cache are, for sampled checks (``verify_sample``).

A check compares a cached chunk with the one vLLM just computed value by value, each layer's
K and V on its own scale (``kvtier.store.tolerance``). For that it needs how K and V lie in
a page (``kv_run``): by vLLM's logical page ``[heads, tokens, content]`` a token's content
for one head is its K, then its V (``head_size`` values each); vLLM's CPU attention reads a
head's content as its tokens' K, then their V (``block_size * head_size`` values each). A
page that holds one latent (MLA), or is packed or padded otherwise, is one part.

It also needs the values' real format (``value_dtype``): vLLM keeps an fp8 cache as
``torch.uint8`` (``cache_dtype`` fp8, fp8_e4m3, fp8_e5m2), whose bytes a check decodes as
the fp8 format they hold, so that a value one fp8 rounding step off (a recompute in another
batch shape) is not taken for wrong KV. A cache whose pages hold more than plain values
(inline scales, quantization modes, integers) has no format kvtier decodes.
"""

from __future__ import annotations

from typing import Any


def kv_run(spec: Any) -> int:
    """Values in one run of K (then of V) in a page of ``spec`` (vLLM's ``KVCacheSpec``);
    0 when a page is one part."""
    if type(spec).__name__.startswith("MLA") or not hasattr(spec, "head_size"):
        return 0
    plain = spec.num_kv_heads * spec.block_size * 2 * spec.head_size * spec.dtype.itemsize
    if spec.page_size_bytes != plain or int(getattr(spec, "kv_quant_mode", 0) or 0):
        return 0
    return spec.head_size * (spec.block_size if _on_cpu() else 1)


def value_dtype(spec: Any, cache_dtype: str) -> str:
    """The torch dtype (by name) a page's values of ``spec`` decode as, under vLLM's
    ``cache_dtype``; ``BYTES`` when kvtier cannot decode them (compared byte for byte)."""
    quant = int(getattr(spec, "kv_quant_mode", 0) or 0)
    plain = not quant and (not hasattr(spec, "head_size") or type(spec).__name__.startswith("MLA")
                           or spec.page_size_bytes == spec.num_kv_heads * spec.block_size * 2
                           * spec.head_size * spec.dtype.itemsize)
    if not plain:
        return BYTES
    if cache_dtype in ("fp8", "fp8_e4m3"):
        return _fp8_e4m3()
    if cache_dtype == "fp8_e5m2":
        return "float8_e5m2"
    dtype = getattr(spec, "dtype", None)
    floating = dtype is not None and dtype.is_floating_point
    return str(dtype).removeprefix("torch.") if floating and cache_dtype in FLOAT_CACHES else BYTES


BYTES = "bytes"  # values kvtier cannot decode
FLOAT_CACHES = ("auto", "bfloat16", "float16", "half", "float", "float32", "fp8_inc")


def _fp8_e4m3() -> str:
    """vLLM's fp8 (e4m3) format here: float8_e4m3fnuz on some ROCm GPUs."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - the connector runs in vLLM
        return "float8_e4m3fn"
    return str(current_platform.fp8_dtype()).removeprefix("torch.")


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - the connector runs in vLLM
        return False
    return bool(current_platform.is_cpu())
