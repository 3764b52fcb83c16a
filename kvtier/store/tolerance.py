"""How close cached KV must be to KV computed now to count as the same (``verify_sample``).

An engine whose kernels are deterministic computes a prompt's KV to the same bytes every
time. Most are not across batch shapes: a GPU's matmul splits its sums by the batch, and
even vLLM's CPU build moved up to 1e-6 of the values' scale in float32 between a prompt
computed alone and in a batch (``scripts/kv_determinism.py``). Wrong KV, another prompt's or
another layout's, differs by the scale itself. So a chunk is compared as a whole: the
largest difference of any value must be within ``tolerance`` times the largest magnitude of
the fresh values. The default per dtype leaves room for several rounding steps of that
dtype's precision, and stays far below what a wrong chunk shows; calibrate it on a GPU with
``scripts/kv_determinism.py`` (docs/reliability.md).
"""

from __future__ import annotations

import torch

DEFAULT_TOLERANCE = {  # relative to the chunk's largest fresh value
    "float32": 1e-3,
    "float16": 1e-2,
    "bfloat16": 4e-2,
}
EXACT = 0.0  # a dtype not listed (an fp8 or integer cache): compared byte for byte


def default_tolerance(dtype: str) -> float:
    """The tolerance for KV of ``dtype`` (a torch dtype's name: ``bfloat16``)."""
    return DEFAULT_TOLERANCE.get(dtype.removeprefix("torch."), EXACT)


def same_kv(cached: torch.Tensor, fresh: torch.Tensor, dtype: str, tolerance: float) -> bool:
    """Whether ``cached`` holds the same KV as ``fresh`` (both bytes, the same length, of KV
    of ``dtype``): byte for byte at tolerance 0 or for a dtype with no float view, else
    ``within`` ``tolerance``."""
    if cached.shape != fresh.shape:
        return False
    name = dtype.removeprefix("torch.")
    view = getattr(torch, name, None)
    if tolerance == 0.0 or name not in DEFAULT_TOLERANCE or not isinstance(view, torch.dtype):
        return bool(torch.equal(cached, fresh))
    return within(cached.view(view), fresh.view(view), tolerance)


def within(cached: torch.Tensor, fresh: torch.Tensor, tolerance: float) -> bool:
    """Whether every value of ``cached`` is within ``tolerance`` times the largest magnitude
    of ``fresh`` of its value there (NaN only where NaN)."""
    a, b = cached.float(), fresh.float()
    if a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    if not b.numel():
        return True
    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    return float((a - b).abs().max()) <= tolerance * float(b.abs().max())
