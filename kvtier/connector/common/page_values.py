"""What the values in a page of vLLM's KV cache are, for sampled checks (``verify_sample``).

A check compares a cached chunk with the one vLLM just computed value by value, each layer's
K and V on its own scale (``kvtier.store.tolerance``). For that it needs how K and V lie in
a page (``kv_run``): by vLLM's logical page ``[heads, tokens, content]`` a token's content
for one head is its K, then its V (``head_size`` values, then ``head_size_v``: a model's V
heads may be smaller than its K heads); vLLM's CPU attention reads a head's content as its
tokens' K, then their V (``block_size * head_size`` values each; with V heads of another
size, one part). A page that holds one latent (MLA), or is packed or padded otherwise, is
one part.

It also needs the values' real format (``value_dtype``): vLLM keeps an fp8 cache as
``torch.uint8`` (``cache_dtype`` fp8, fp8_e4m3, fp8_e5m2), whose bytes a check decodes as
the fp8 format they hold, so that a value one fp8 rounding step off (a recompute in another
batch shape) is not taken for wrong KV. A cache whose pages hold more than plain values
(inline scales, quantization modes, integers) has no format kvtier decodes.
"""

from __future__ import annotations

from typing import Any


def kv_run(spec: Any) -> tuple[int, int]:
    """Values in one run of K, and in the run of V after it, in a page of ``spec`` (vLLM's
    ``KVCacheSpec``); (0, 0) when a page is one part."""
    if type(spec).__name__.startswith("MLA") or not hasattr(spec, "head_size") or not _plain(spec):
        return 0, 0
    k, v = spec.head_size, _head_size_v(spec)
    if not v:  # one latent, no V
        return 0, 0
    if _on_cpu():
        return (k * spec.block_size,) * 2 if k == v else (0, 0)
    return k, v


def value_dtype(spec: Any, cache_dtype: str) -> str:
    """The torch dtype (by name) a page's values of ``spec`` decode as, under vLLM's
    ``cache_dtype``; ``BYTES`` when kvtier cannot decode them (compared byte for byte)."""
    if not _plain(spec):
        return BYTES
    if cache_dtype in ("fp8", "fp8_e4m3"):
        return _fp8_e4m3()
    if cache_dtype == "fp8_e5m2":
        return "float8_e5m2"
    dtype = getattr(spec, "dtype", None)
    floating = dtype is not None and dtype.is_floating_point
    return str(dtype).removeprefix("torch.") if floating and cache_dtype in FLOAT_CACHES else BYTES


def _plain(spec: Any) -> bool:
    """Whether a page of ``spec`` holds its values and nothing else: K and V of each head and
    token (or one latent, MLA), no inline scales, packing or padding."""
    if int(getattr(spec, "kv_quant_mode", 0) or 0):
        return False
    if not hasattr(spec, "head_size") or type(spec).__name__.startswith("MLA"):
        return True
    content = spec.head_size + _head_size_v(spec)
    return bool(spec.page_size_bytes == spec.num_kv_heads * spec.block_size * content * spec.dtype.itemsize)


def _head_size_v(spec: Any) -> int:
    """Values of V a head holds for a token (vLLM's ``head_size_v``; as K's where unset)."""
    size = getattr(spec, "head_size_v", None)
    return int(spec.head_size if size is None else size)


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
