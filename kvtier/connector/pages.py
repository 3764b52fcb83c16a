"""Copying whole pages between vLLM's paged KV cache and kvtier's host slots.

A chunk in a host slot is ``(num_layers, blocks_per_chunk, page_bytes)``, layers in KV cache
group order (see ``geometry``); its block ids are each group's blocks, group after group.
On the CPU, pages move as slice copies, one per run of consecutive block ids per layer
(memcpy, GIL released; measured 10x faster than ``index_copy_`` here); into the cache they
are numpy copies (about 2x torch's for a 64 KiB page here, measured: less to set up per
copy, and no OpenMP team started for it). On CUDA, pages are
gathered on the device and copied to pinned host memory on a side stream (and back), and the
caller waits on the stream before reporting completion. A load skips vLLM's null block (a
sliding-window group keeps no page for tokens out of its window).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.connector.geometry import KVGeometry
from kvtier.connector.messages import NULL_BLOCK
from kvtier.connector.page_view import page_view


class PagedKV:
    """The engine's per-layer KV tensors seen as byte pages, ``(num_blocks, *runs)`` each
    (``page_view``: one run, or one per head where the heads are outside the block)."""

    def __init__(self, layers: Sequence[torch.Tensor], geometry: KVGeometry) -> None:
        if len(layers) != geometry.num_layers:
            raise ValueError(f"kvtier: {len(layers)} KV tensors, expected {geometry.num_layers}")
        self.pages = [page_view(_manager_blocks(t, geometry.page_bytes)) for t in layers]
        self._runs = [tuple(p.shape[1:]) for p in self.pages]
        sizes = {math.prod(runs) for runs in self._runs}
        if sizes != {geometry.page_bytes}:
            raise ValueError(f"kvtier: KV pages of {sorted(sizes)} bytes, expected "
                             f"{geometry.page_bytes} (vLLM's KV cache layout changed?)")
        self.device = self.pages[0].device
        self._arrays = [p.numpy() for p in self.pages] if self.device.type == "cpu" else []
        self.num_blocks = min(p.shape[0] for p in self.pages)
        self.geometry = geometry
        bounds = list(itertools.accumulate(geometry.groups, initial=0))
        self._groups = [range(a, b) for a, b in itertools.pairwise(bounds)]
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def _per_group(self, block_ids: Sequence[int]) -> list[tuple[range, Sequence[int]]]:
        """(layers, block ids) of each KV cache group, after checking the ids on the host:
        a slice past the end copies nothing without a word, and an index past the end on
        CUDA is a device-side assert."""
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise IndexError(f"kvtier: block ids {min(block_ids)}..{max(block_ids)} outside the "
                             f"KV cache's {self.num_blocks} blocks")
        count, odd = divmod(len(block_ids), len(self._groups))
        if odd:
            raise ValueError(f"kvtier: {len(block_ids)} block ids for {len(self._groups)} KV "
                             "cache groups (each group's blocks, group after group)")
        return [(layers, block_ids[g * count:(g + 1) * count])
                for g, layers in enumerate(self._groups)]

    def _chunk(self, slot: torch.Tensor) -> torch.Tensor:
        return slot[: self.geometry.chunk_bytes].view(self.geometry.num_layers, -1,
                                                      self.geometry.page_bytes)

    def gather(self, block_ids: Sequence[int], slot: torch.Tensor) -> None:
        """Copy the pages of ``block_ids`` (every layer) into ``slot`` (host bytes). Fewer
        blocks than a chunk's (a prompt's tail) leave the rest of the slot zeroed, so that
        nothing of the slot's previous chunk is written out with it."""
        if NULL_BLOCK in block_ids:
            raise ValueError("kvtier: a store of vLLM's null block (a page out of a sliding "
                             "window holds nothing)")
        groups, chunk = self._per_group(block_ids), self._chunk(slot)
        count = len(groups[0][1]) if groups else 0
        if count < chunk.shape[1]:
            chunk[:, count:].zero_()
        if self._stream is None:
            for layers, ids in groups:
                for start, first, count in _runs(ids):
                    for layer in layers:
                        chunk[layer, start:start + count].view(count, *self._runs[layer]).copy_(
                            self.pages[layer][first:first + count])
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for layers, ids in groups:
                index = self._ids(ids)
                for layer in layers:
                    chunk[layer, : len(ids)].view(len(ids), *self._runs[layer]).copy_(
                        self.pages[layer].index_select(0, index), non_blocking=True)

    def bytes_of(self, block_ids: Sequence[int]) -> int:
        """Bytes a load of ``block_ids`` copies (the null block's pages are not)."""
        return sum(len(layers) * sum(1 for b in ids if b != NULL_BLOCK)
                   for layers, ids in self._per_group(block_ids)) * self.geometry.page_bytes

    def scatter(self, slot: torch.Tensor, block_ids: Sequence[int], first: int) -> None:
        """Copy pages ``first ...`` of the chunk in ``slot`` into ``block_ids`` (the null
        block skipped)."""
        groups, chunk = self._per_group(block_ids), self._chunk(slot)
        if self._stream is None:
            rows = chunk.numpy()
            for layers, ids in groups:
                for start, block, count in _runs(ids):
                    at = first + start
                    for layer in layers:
                        np.copyto(self._arrays[layer][block:block + count],
                                  rows[layer, at:at + count].reshape(count, *self._runs[layer]))
            return
        with torch.cuda.stream(self._stream):
            for layers, ids in groups:
                kept = [i for i, block in enumerate(ids) if block != NULL_BLOCK]
                if not kept:
                    continue
                index, picked = self._ids([ids[i] for i in kept]), self._ids(kept)
                for layer in layers:
                    span = chunk[layer, first:first + len(ids)].view(len(ids), *self._runs[layer])
                    span = span.to(self.device, non_blocking=True)
                    if len(kept) < len(ids):
                        span = span.index_select(0, picked)
                    self.pages[layer].index_copy_(0, index, span)

    def synchronize(self) -> None:
        """Wait for copies started on the side stream (no-op on the CPU)."""
        if self._stream is not None:
            self._stream.synchronize()


def in_chunk_order(kv_caches: dict[str, torch.Tensor], geometry: KVGeometry) -> list[torch.Tensor]:
    """vLLM's KV tensors in the order of the layers in a chunk (KV cache group by group),
    or as registered when the geometry names no layers."""
    names = geometry.layer_names
    if not names:
        return list(kv_caches.values())
    missing = set(names) - set(kv_caches)  # more is fine: layers sharing another's KV
    if missing:
        raise ValueError(f"kvtier: vLLM registered no KV tensor for {sorted(missing)}, "
                         "which its KV cache groups name")
    return [kv_caches[name] for name in names]


def _manager_blocks(tensor: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """A layer ``[B, H, N, C]`` whose attention kernel splits each of vLLM's blocks into
    ``k`` kernel blocks (dim 0 has ``k`` dense entries per block) seen with one entry per
    block, ``[B, k, H, N / k, C]``. Only where the kernel blocks lie token after token (tokens
    outside heads), so that a page's bytes are those of an engine that does not split; with
    heads outside tokens they would be another order under the same namespace: refused."""
    kernel_page = tensor[0].numel() * tensor.element_size()
    if (tensor.dim() != 4 or kernel_page >= page_bytes or page_bytes % kernel_page
            or tensor.stride(0) * tensor.element_size() != kernel_page
            or tensor.shape[0] % (page_bytes // kernel_page)):
        return tensor  # one entry per block (or a mismatch, refused by the page size check)
    split = tensor.unflatten(0, (-1, page_bytes // kernel_page))
    if split.stride(1) != split.shape[3] * split.stride(3):
        raise ValueError(
            f"kvtier: the attention kernel splits each {page_bytes}-byte page into "
            f"{page_bytes // kernel_page} kernel blocks laid out with heads outside tokens; the "
            "pages' bytes would differ from an engine that does not split. Set vLLM's block "
            "size to the kernel's block size, or use a layout with tokens outside heads")
    return split


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(index in ``block_ids``, first block id, length) of each run of consecutive ids, the
    null block left out."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(block_ids):
        if block == NULL_BLOCK:
            continue
        if runs and runs[-1][1] + runs[-1][2] == block and runs[-1][0] + runs[-1][2] == i:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((i, block, 1))
    return runs
