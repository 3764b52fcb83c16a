"""Copying whole pages between vLLM's paged KV cache and kvtier's host slots.

A chunk in a host slot is ``(num_layers, blocks_per_chunk, page_bytes)``. On the CPU, pages
move as slice copies, one per run of consecutive block ids per layer (memcpy, GIL released;
measured 10x faster than ``index_copy_`` here). On CUDA, pages are gathered on the device and
copied to pinned host memory on a side stream (and back), and the caller waits on the stream
before reporting completion.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.connector.geometry import KVGeometry


class PagedKV:
    """The engine's per-layer KV tensors seen as ``(num_blocks, page_bytes)`` byte pages."""

    def __init__(self, layers: Sequence[torch.Tensor], geometry: KVGeometry) -> None:
        if len(layers) != geometry.num_layers:
            raise ValueError(f"kvtier: {len(layers)} KV tensors, expected {geometry.num_layers}")
        self.pages = [self._as_pages(t) for t in layers]
        sizes = {p.shape[1] for p in self.pages}
        if sizes != {geometry.page_bytes}:
            raise ValueError(f"kvtier: KV pages of {sorted(sizes)} bytes, expected "
                             f"{geometry.page_bytes} (vLLM's KV cache layout changed?)")
        self.device = self.pages[0].device
        self.num_blocks = min(p.shape[0] for p in self.pages)
        self.geometry = geometry
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @staticmethod
    def _as_pages(tensor: torch.Tensor) -> torch.Tensor:
        pages = tensor.flatten(1)
        if pages.stride(1) != 1:
            raise ValueError("kvtier: a KV page is not contiguous; cannot copy it as bytes")
        return pages.view(torch.uint8)

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def _check(self, block_ids: Sequence[int]) -> None:
        """Block ids in range, checked on the host: a slice past the end copies nothing
        without a word, and an index past the end on CUDA is a device-side assert."""
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise IndexError(f"kvtier: block ids {min(block_ids)}..{max(block_ids)} outside the "
                             f"KV cache's {self.num_blocks} blocks")

    def gather(self, block_ids: Sequence[int], slot: torch.Tensor) -> None:
        """Copy the pages of ``block_ids`` (every layer) into ``slot`` (host bytes)."""
        self._check(block_ids)
        chunk = slot[: self.geometry.chunk_bytes].view(self.geometry.num_layers, -1,
                                                       self.geometry.page_bytes)
        if self._stream is None:
            for start, first, count in _runs(block_ids):
                for layer, pages in enumerate(self.pages):
                    chunk[layer, start:start + count].copy_(pages[first:first + count])
            return
        ids = self._ids(block_ids)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for layer, pages in enumerate(self.pages):
                chunk[layer, : len(block_ids)].copy_(pages.index_select(0, ids), non_blocking=True)

    def scatter(self, slot: torch.Tensor, block_ids: Sequence[int], first: int) -> None:
        """Copy pages ``first ...`` of the chunk in ``slot`` into ``block_ids``."""
        self._check(block_ids)
        chunk = slot[: self.geometry.chunk_bytes].view(self.geometry.num_layers, -1,
                                                       self.geometry.page_bytes)
        if self._stream is None:
            for start, block, count in _runs(block_ids):
                for layer, pages in enumerate(self.pages):
                    pages[block:block + count].copy_(chunk[layer, first + start:first + start + count])
            return
        ids = self._ids(block_ids)
        span = slice(first, first + len(block_ids))
        with torch.cuda.stream(self._stream):
            for layer, pages in enumerate(self.pages):
                pages.index_copy_(0, ids, chunk[layer, span].to(self.device, non_blocking=True))

    def synchronize(self) -> None:
        """Wait for copies started on the side stream (no-op on the CPU)."""
        if self._stream is not None:
            self._stream.synchronize()


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(index in ``block_ids``, first block id, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((i, block, 1))
    return runs
