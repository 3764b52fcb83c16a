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
dtype leaves room for several rounding steps of that dtype's precision (for an fp8 cache,
whose bytes are decoded as the fp8 format they hold, two steps), and stays far below what a
wrong chunk shows; a cache whose values kvtier cannot decode is compared byte for byte, and
bytes that differ there say nothing either way (``same_kv`` gives None). Calibrate it on a
GPU with ``scripts/kv_determinism.py`` (docs/reliability.md).
"""

from __future__ import annotations

import torch

DEFAULT_TOLERANCE = {  # relative to the largest fresh value of each part
    "float32": 1e-3,
    "float16": 1e-2,
    "bfloat16": 4e-2,
    # fp8: a value one rounding step off moves by at most 1/8 (e4m3, 3 mantissa bits) or
    # 1/4 (e5m2) of its part's largest value; two steps of room
    "float8_e4m3fn": 0.25,
    "float8_e4m3fnuz": 0.25,
    "float8_e5m2": 0.5,
    "float8_e5m2fnuz": 0.5,
}


def default_tolerance(dtype: str) -> float | None:
    """The tolerance for KV of ``dtype`` (a torch dtype's name: ``bfloat16``); None for a
    dtype whose values kvtier does not decode (an integer cache, uint8 bytes of unknown
    format)."""
    return DEFAULT_TOLERANCE.get(dtype.removeprefix("torch."))


def same_kv(cached: torch.Tensor, fresh: torch.Tensor, dtype: str, tolerance: float | None,
            pages: int = 1, kv_run: tuple[int, int] = (0, 0)) -> bool | None:
    """Whether ``cached`` holds the same KV as ``fresh`` (both bytes, the same length, of KV
    of ``dtype``, ``pages`` pages one after the other): ``within`` ``tolerance`` (None: the
    dtype's ``default_tolerance``), each page's K and V apart (``kv_parts``); byte for byte
    at tolerance 0. For a dtype kvtier cannot decode, bytes that differ are None (cannot
    tell: a recompute need not give the same bytes) unless ``tolerance`` is 0."""
    if cached.shape != fresh.shape:
        return False
    name = dtype.removeprefix("torch.")
    view = getattr(torch, name, None)
    decodable = name in DEFAULT_TOLERANCE and isinstance(view, torch.dtype)
    if tolerance is None:
        tolerance = default_tolerance(name)
    if not decodable or tolerance == 0.0:
        if torch.equal(cached, fresh):
            return True
        return False if tolerance == 0.0 else None
    assert isinstance(view, torch.dtype) and tolerance is not None
    a, b = (kv_parts(t.reshape(pages, -1).view(view), kv_run) for t in (cached, fresh))
    return all(within(x, y, tolerance) for x, y in zip(a, b, strict=True))


def kv_parts(values: torch.Tensor, kv_run: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """Pages of values ``(pages, n)`` as parts, each ``(pages, m)`` (a row a part): every
    page's K, and every page's V, where a page holds a run of ``kv_run[0]`` values of K then
    one of ``kv_run[1]`` of V, in turn (vLLM: a head's K then its V for each token, the
    runs its K and V head sizes; or each head's tokens' K then V); each page whole without
    runs, or where its values do not fall in them evenly (padding)."""
    pages, n = values.shape
    k, v = kv_run
    if not k or not v or n % (k + v):
        return (values,)
    runs = values.view(pages, -1, k + v)
    return runs[..., :k].reshape(pages, -1), runs[..., k:].reshape(pages, -1)


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
