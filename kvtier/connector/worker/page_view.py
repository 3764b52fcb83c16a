"""One layer's KV cache as pages of bytes, whatever ``KVCacheLayout`` vLLM picked.

vLLM hands a connector one tensor per layer, logically ``[B, H, N, C]`` (blocks, heads,
tokens in a block, content), laid out in memory in one of several orders (``vllm/v1/
kv_cache_layout.py``): layers outermost or blocks outermost, heads inside a block or outside
it. A page (one block of one layer) is then one contiguous run of bytes (LBHNC, LBNHC,
BLHNC, BLNHC) or one run per head (LHBNC, BHLNC: the heads are outside the block).

``page_view`` returns the layer as a uint8 view ``(B, *runs)`` whose dims after the first
are the page's dims in memory order, with every dim that is contiguous with the next merged
into it: ``(B, page_bytes)`` for a contiguous page, ``(B, H, N * C)`` for a page of one run
per head. A page's bytes in a chunk are that view's bytes in C order, so copying a run of
blocks is one strided copy per layer and the bytes are the page's memory bytes, run after
run. The order of a page's dims (heads then tokens, or tokens then heads) is part of the
namespace (``geometry``): caches of engines whose pages differ never mix.
"""

from __future__ import annotations

import math

import torch


def page_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (blocks first, its last dim contiguous) as ``(blocks, *runs)`` bytes."""
    if tensor.dim() < 2 or tensor.stride(-1) != 1:
        raise ValueError(f"kvtier: a KV cache tensor of shape {tuple(tensor.shape)} and strides "
                         f"{tensor.stride()}: its last dim is not contiguous; cannot copy its "
                         "pages as bytes")
    data = tensor.view(torch.uint8)
    dims = sorted(zip(data.shape[1:], data.stride()[1:], strict=True), key=lambda d: -d[1])
    merged: list[tuple[int, int]] = []
    for size, stride in dims:
        if size == 1:
            continue  # no extent: its stride says nothing
        merged.append((size, stride))
    runs: list[tuple[int, int]] = []
    for size, stride in reversed(merged):  # innermost first
        if runs and stride == runs[-1][0] * runs[-1][1]:
            runs[-1] = (runs[-1][0] * size, runs[-1][1])
        else:
            runs.append((size, stride))
    runs.reverse()
    if not runs or runs[-1][1] != 1:
        runs.append((1, 1))
    sizes, strides = zip(*runs, strict=True)
    view = data.as_strided((data.shape[0], *sizes), (data.stride(0), *strides))
    if math.prod(sizes) != math.prod(data.shape[1:]):
        raise ValueError(f"kvtier: cannot see a KV cache tensor of shape {tuple(tensor.shape)} "
                         f"and strides {tensor.stride()} as pages of bytes")
    return view
