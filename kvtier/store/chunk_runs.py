"""A KV tensor seen as runs of whole chunks, as raw integers: the caller's side of the copies
of a ``put`` or ``get`` and the host tier's slots.

A run is a ``(count, layers, 2, chunk_tokens, hidden)`` view of integers of the KV's element
size, so a copy moves bytes and never converts. The caller's tensor, when on the CPU, and the
host tier's slots are numpy views, made once (per call, per store) and sliced per run: a
numpy slice costs a fraction of a microsecond, a chain of torch view ops several, which on
small chunks was most of a put's cost. Elsewhere (a tensor on a GPU, a GPU tier's slots) they
are torch views.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.errors import LayoutError

# the integer type of each element size: copies through it move bytes and never convert
RAW_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
RAW_NUMPY = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

Run = np.ndarray | torch.Tensor


def as_raw(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory as integers of the same size (same shape and strides)."""
    return tensor.view(RAW_TORCH[tensor.element_size()])


class ChunkRuns:
    """``kv`` (``(layers, 2, tokens, hidden)``, tokens at least ``count * chunk_tokens``) as
    its first ``count`` chunks; ``run(first, n)`` is chunks ``first`` to ``first + n - 1``,
    a view of ``kv``'s memory (writing to it writes ``kv``). A tensor to be written
    (``into``) must not be expanded (a stride of 0: elements sharing memory) nor require
    grad (``LayoutError``)."""

    def __init__(self, kv: torch.Tensor, chunk_tokens: int, count: int, into: bool = False) -> None:
        if into and any(stride == 0 and size > 1 for size, stride in zip(kv.shape, kv.stride(),
                                                                          strict=True)):
            raise LayoutError(
                f"out has elements that share memory (shape {tuple(kv.shape)}, strides "
                f"{kv.stride()}: an expanded tensor); get needs a tensor with memory of its "
                "own for every element, such as torch.empty(...) or store.empty_kv(...)")
        if into and kv.requires_grad:
            raise LayoutError("out requires grad; get writes into it in place, which autograd "
                              "cannot follow: pass a tensor that does not (out.detach())")
        self.tensor, self._tokens = kv, chunk_tokens
        self._array: np.ndarray | None = None
        if kv.device.type == "cpu" and count > 0:
            raw = as_raw(kv.detach()).numpy()
            layers, two, _, hidden = raw.shape
            s_layer, s_two, s_token, s_hidden = raw.strides
            # the token axis split into (count, chunk_tokens), chunks first: a view by
            # construction (reshape would copy silently where strides do not allow a view)
            self._array = np.lib.stride_tricks.as_strided(
                raw, shape=(count, layers, two, chunk_tokens, hidden),
                strides=(chunk_tokens * s_token, s_layer, s_two, s_token, s_hidden))

    def run(self, first: int, count: int) -> Run:
        if self._array is not None:
            return self._array[first:first + count]
        tokens = self._tokens
        chunks = self.tensor[:, :, first * tokens:(first + count) * tokens]
        return as_raw(chunks.unflatten(2, (count, tokens)).movedim(2, 0))


def slot_rows(buffer: np.ndarray, num_slots: int, slot_bytes: int, chunk_bytes: int,
              element_bytes: int, chunk_shape: tuple[int, ...]) -> np.ndarray:
    """The host tier's slots (``buffer``: ``num_slots * slot_bytes`` bytes) as one
    ``(num_slots, *chunk_shape)`` numpy view of raw integers: slot ``i``'s chunk is row
    ``i``, a run of slots a slice."""
    slots = buffer[: num_slots * slot_bytes].reshape(num_slots, slot_bytes)[:, :chunk_bytes]
    return slots.view(RAW_NUMPY[element_bytes]).reshape(num_slots, *chunk_shape)


def copy_run(dst: Run, src: Run, threads: bool) -> None:
    """Copy run ``src`` into ``dst`` (same shape). Between CPU arrays: ``numpy.copyto`` on
    this thread, or with ``threads`` torch's copy, which splits a large one over its
    threads (they then wait spinning for more: not while I/O needs the cores)."""
    if not threads and _on_cpu(dst) and _on_cpu(src):
        np.copyto(_as_array(dst), _as_array(src))
        return
    target = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
    source = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
    target.copy_(source)


def _on_cpu(run: Run) -> bool:
    return isinstance(run, np.ndarray) or run.device.type == "cpu"


def _as_array(run: Run) -> np.ndarray:
    return run if isinstance(run, np.ndarray) else run.detach().numpy()
