"""How close cached KV must be to KV computed now to count as the same (``verify_sample``).

An engine whose kernels are deterministic computes a prompt's KV to the same bytes every
time. Most are not across batch shapes: a GPU's matmul splits its sums by the batch, and
even vLLM's CPU build moved up to 1e-6 of the values' scale in float32 between a prompt
computed alone and in a batch (``scripts/kv_determinism.py``). Wrong KV, another prompt's or
another layout's, differs by the scale itself. So each part of a chunk is compared on its
own scale: the largest difference of any value must be within ``tolerance`` times the
largest finite magnitude of the fresh values of its part, where a part is one layer's K or
V (in vLLM, of one page): one bound for the whole chunk would let a V part, or a layer of
small values, replaced by another prompt's pass under the scale of the largest. NaN and
infinities must sit at the same places (an infinity never sets a scale). The default per
dtype leaves room for several rounding steps of that dtype's precision, and stays far below
what a wrong chunk shows; calibrate it on a GPU with ``scripts/kv_determinism.py``
(docs/reliability.md).
"""

from __future__ import annotations

import torch

DEFAULT_TOLERANCE = {  # relative to the largest fresh value of each part
    "float32": 1e-3,
    "float16": 1e-2,
    "bfloat16": 4e-2,
}
EXACT = 0.0  # a dtype not listed (an fp8 or integer cache): compared byte for byte


def default_tolerance(dtype: str) -> float:
    """The tolerance for KV of ``dtype`` (a torch dtype's name: ``bfloat16``)."""
    return DEFAULT_TOLERANCE.get(dtype.removeprefix("torch."), EXACT)


def same_kv(cached: torch.Tensor, fresh: torch.Tensor, dtype: str, tolerance: float,
            pages: int = 1, kv_run: int = 0) -> bool:
    """Whether ``cached`` holds the same KV as ``fresh`` (both bytes, the same length, of KV
    of ``dtype``, ``pages`` pages one after the other): byte for byte at tolerance 0 or for
    a dtype with no float view, else ``within`` ``tolerance``, each page's K and V apart
    (``kv_parts``)."""
    if cached.shape != fresh.shape:
        return False
    name = dtype.removeprefix("torch.")
    view = getattr(torch, name, None)
    if tolerance == 0.0 or name not in DEFAULT_TOLERANCE or not isinstance(view, torch.dtype):
        return bool(torch.equal(cached, fresh))
    a, b = (kv_parts(t.reshape(pages, -1).view(view), kv_run) for t in (cached, fresh))
    return within(a, b, tolerance)


def kv_parts(values: torch.Tensor, kv_run: int) -> torch.Tensor:
    """Pages of values ``(pages, n)`` as parts ``(parts, m)``: each page's K then its V, where
    a page holds runs of ``kv_run`` values of K and of V in turn (vLLM: a head's K then its
    V for each token, ``kv_run`` = head size; or each head's tokens' K then V); each page
    whole without runs, or where its values do not fall in them evenly (padding)."""
    pages, n = values.shape
    if not kv_run or n % (2 * kv_run):
        return values
    return values.view(pages, -1, 2, kv_run).transpose(1, 2).reshape(2 * pages, -1)


def within(cached: torch.Tensor, fresh: torch.Tensor, tolerance: float) -> bool:
    """Whether every value of ``cached`` is within ``tolerance`` times the largest finite
    magnitude of its part of ``fresh`` (a part: an index of dim 0) of its value there; NaN
    only where NaN, and each infinity only where the same one is."""
    a, b = cached.float(), fresh.float()
    if a.shape != b.shape:
        return False
    if not b.numel():
        return True
    parts = b.shape[0] if b.dim() else 1
    a, b = a.reshape(parts, -1), b.reshape(parts, -1)
    for mask in (torch.isnan, torch.isposinf, torch.isneginf):
        if not torch.equal(mask(a), mask(b)):
            return False
    finite = b.isfinite()
    a, b = a.where(finite, 0.0), b.where(finite, 0.0)
    scale = b.abs().amax(dim=1, keepdim=True)
    return bool(((a - b).abs() <= tolerance * scale).all())
