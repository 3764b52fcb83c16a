"""What the values in a page of vLLM's KV cache are, for sampled checks (``verify_sample``).

A check compares a cached chunk with the one vLLM just computed value by value, each layer's
K and V on its own scale (``kvtier.store.tolerance``). For that it needs how K and V lie in
a page (``kv_run``): by vLLM's logical page ``[heads, tokens, content]`` a token's content
for one head is its K, then its V (``head_size`` values each); vLLM's CPU attention reads a
head's content as its tokens' K, then their V (``block_size * head_size`` values each). A
page that holds one latent (MLA), or is packed or padded otherwise, is one part.
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


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - the connector runs in vLLM
        return False
    return bool(current_platform.is_cpu())
