"""Reads straight into the caller's tensor: where each chunk of a ``get`` lands in it.

A ``get`` into a tensor made by ``KVStore.empty_kv`` reads disk chunks into it directly (one
vectored read scatters a chunk's payload over its ``layers * 2`` rows), with no copy through
host memory. Each chunk's part of a row must be whole pages (O_DIRECT needs it, and a read
given up on detaches whole pages, which must hold nothing else); any other tensor is read
through host slots.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from kvtier.disk.tier import IOV_MAX
from kvtier.io.buffers import PAGE, align_up
from kvtier.io.direct_buffer import DirectBuffer, DirectBuffers, Rows
from kvtier.layout import DTYPE_BYTES, KVLayout
from kvtier.units import positive_count

_GEOMETRIES = 64  # tensor geometries whose rows are remembered between gets
_UNKNOWN = object()


def empty_kv(buffers: DirectBuffers, layout: KVLayout, num_tokens: int) -> torch.Tensor:
    """A ``(layers, 2, num_tokens, hidden)`` tensor on a direct buffer of ``buffers``, each
    ``(layer, K or V)`` row starting on a page (contents: zeros)."""
    tokens = positive_count(num_tokens)
    if not tokens:
        raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
    element = DTYPE_BYTES[layout.dtype]
    row = align_up(tokens * layout.hidden * element, PAGE) // element
    size, memory = layout.num_layers * 2 * row * element, os.sysconf("SC_PHYS_PAGES") * PAGE
    if size > memory:
        raise ValueError(f"empty_kv({tokens}) needs {size} bytes, more than this machine's "
                         f"memory ({memory} bytes); ask for fewer tokens")
    buffer = buffers.new(size)
    flat = torch.from_numpy(buffer.array()).view(getattr(torch, layout.dtype))
    return flat.as_strided(layout.shape(tokens), (2 * row, row, layout.hidden, 1))


def claim(buffers: DirectBuffers, out: torch.Tensor) -> AbstractContextManager[None]:
    """For one ``get`` into ``out``: its bytes to itself when they are on a direct buffer of
    ``buffers`` (a second get into them waits), as a read given up on detaches pages there
    whoever else loaded them; nothing to hold for any other tensor."""
    if out.device.type != "cpu" or out.numel() == 0 \
            or buffers.find(out.data_ptr(), _extent(out)) is None:
        return nullcontext()
    return buffers.claim(_rows_of(out))


def _rows_of(out: torch.Tensor) -> Rows:
    """``out``'s bytes as rows: its ``(layer, K or V)`` rows when they lie evenly apart (a
    tensor from ``empty_kv``, or a slice of one), else its whole span as one row."""
    size = out.element_size()
    if out.dim() == 4 and out.shape[0] * out.shape[1] > 1 and out.stride(0) == out.shape[1] * out.stride(1):
        row = (out.shape[2] - 1) * out.stride(2) + (out.shape[3] - 1) * out.stride(3) + 1
        if row <= out.stride(1):
            return Rows(out.data_ptr(), out.stride(1) * size, out.shape[0] * out.shape[1], row * size)
    return Rows(out.data_ptr(), _extent(out), 1, _extent(out))


class DirectTarget:
    """Where chunk ``i`` of a ``get`` lands in its output tensor: ``pieces(i)`` are the
    buffer's read alias over the chunk's rows, in the slot's payload order; ``detach(i)``
    cuts the caller's pages of those rows loose (a read given up on, see ``DirectBuffer``)."""

    def __init__(self, buffer: DirectBuffer, first: np.ndarray, piece_bytes: int,
                 row_bytes: int) -> None:
        self._buffer, self._first, self._piece = buffer, first, piece_bytes
        gaps = np.diff(first)
        # rows the same distance apart (a tensor from ``empty_kv``): one 2-D view slices them all
        self._rows = None
        if len(first) > 1 and np.all(gaps == gaps[0]) and gaps[0] >= row_bytes:
            self._rows = as_strided(buffer.alias[int(first[0]):], shape=(len(first), row_bytes),
                                    strides=(int(gaps[0]), 1), writeable=True)

    @classmethod
    def of(cls, out: torch.Tensor, buffers: DirectBuffers, chunk_tokens: int) -> DirectTarget | None:
        """The target for ``out``, or None when ``out`` is not on a live, attached direct
        buffer of ``buffers``, its token rows are not contiguous, or a chunk's part of a row
        is not whole pages."""
        if out.device.type != "cpu":
            return None
        buffer = buffers.find(out.data_ptr(), _extent(out))
        if buffer is None or buffer.detached:
            return None
        geometry = (out.data_ptr(), tuple(out.shape), out.stride(), out.element_size(), chunk_tokens)
        cache = buffers.geometry
        found = cache.get(geometry, _UNKNOWN)  # one read: another thread may clear it
        if found is _UNKNOWN:
            found = _rows(out, buffer, chunk_tokens)
            if len(cache) >= _GEOMETRIES:
                cache.clear()
            cache[geometry] = found
        if not isinstance(found, tuple):
            return None
        first, piece, row_bytes = found
        return cls(buffer, first, piece, row_bytes)

    def pieces(self, i: int) -> list[np.ndarray]:
        size = self._piece
        if self._rows is not None:
            return list(self._rows[:, i * size:(i + 1) * size])
        alias = self._buffer.alias
        return [alias[o:o + size] for o in (self._first + i * size).tolist()]

    def detach(self, i: int) -> None:
        """The caller's pages under chunk ``i``'s rows get fresh memory (zeros), for good."""
        size = self._piece
        self._buffer.detach([(o, size) for o in (self._first + i * size).tolist()])


def _rows(out: torch.Tensor, buffer: DirectBuffer, chunk_tokens: int) -> tuple[np.ndarray, int, int] | None:
    """(byte offset in ``buffer`` of each (layer, K or V) row of ``out``, a chunk's bytes in
    a row, a row's bytes), or None when a chunk cannot be read straight into ``out``."""
    layers, kinds = out.shape[0], out.shape[1]
    if out.stride(3) != 1 or out.stride(2) != out.shape[3] or layers * kinds + 1 > IOV_MAX:
        return None
    element = out.element_size()
    piece = chunk_tokens * out.shape[3] * element
    rows = np.add.outer(np.arange(layers) * out.stride(0), np.arange(kinds) * out.stride(1))
    first = (out.data_ptr() - buffer.address) + rows.reshape(-1).astype(np.int64) * element
    row_bytes = out.shape[2] * out.shape[3] * element
    if piece % PAGE or np.any(first % PAGE) or np.any(np.diff(np.sort(first)) < row_bytes):
        return None  # rows that overlap (a broadcast view) would read over each other
    return first, piece, row_bytes


def _extent(out: torch.Tensor) -> int:
    """Bytes from ``out``'s first element to just past its last."""
    last = sum((n - 1) * s for n, s in zip(out.shape, out.stride(), strict=True))
    return (last + 1) * out.element_size()
