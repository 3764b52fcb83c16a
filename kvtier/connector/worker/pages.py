"""Copying whole pages between vLLM's paged KV cache and kvtier's host slots.

A chunk in a host slot is ``(num_layers, blocks_per_chunk, page_bytes)``, layers in KV cache
group order (see ``geometry``); its block ids are each group's blocks, group after group.
On the CPU, pages move as slice copies, one per run of consecutive block ids per layer
(memcpy, GIL released; measured 10x faster than ``index_copy_`` here); into the cache they
are numpy copies (about 2x torch's for a 64 KiB page here, measured: less to set up per
copy, and no OpenMP team started for it). On CUDA, pages are gathered on the device into a
staging chunk and copied to pinned host memory in one copy, on a side stream (and back:
a whole chunk in one copy, then its pages into place), and the caller waits on the stream
before reporting completion. A load skips vLLM's null block (a
sliding-window group keeps no page for tokens out of its window).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import NULL_BLOCK
from kvtier.connector.worker.page_view import page_view


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
        self._stage: torch.Tensor | None = None  # ``_staging``
        # per group, its layers' pages as one view where they lie evenly in one allocation
        # (vLLM's usual case): one gather or scatter kernel for the group, not one per layer
        self._stacks = [_stacked([self.pages[layer] for layer in layers]) if self._stream else None
                        for layers in self._groups]

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``block_ids`` as an index on the device. On CUDA it goes through pinned memory
        without a wait: a copy from pageable memory would block this thread until the side
        stream's earlier copies are over, so no chunk's copies could be queued behind
        another's."""
        if self.device.type != "cuda":
            return torch.tensor(block_ids, dtype=torch.long, device=self.device)
        pinned = torch.tensor(block_ids, dtype=torch.long, pin_memory=True)
        return pinned.to(self.device, non_blocking=True)

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
        if self._stream is not None:
            self._gather_cuda(groups, count, chunk)
            return
        if count < chunk.shape[1]:
            chunk[:, count:].zero_()
        for layers, ids in groups:
            for start, first, count in _runs(ids):
                for layer in layers:
                    chunk[layer, start:start + count].view(count, *self._runs[layer]).copy_(
                        self.pages[layer][first:first + count])

    def _gather_cuda(self, groups: list[tuple[range, Sequence[int]]], count: int,
                     chunk: torch.Tensor) -> None:
        """On the side stream: each layer's pages gathered into the staging chunk on the
        device (the rest of it zeroed), then the whole chunk to pinned host memory in one
        copy (per-layer copies of a megabyte reach about half of one large copy's speed)."""
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            stage = self._staging()
            for (layers, ids), stack in zip(groups, self._stacks, strict=True):
                index = self._ids(ids)
                if stack is not None and len(ids) == stage.shape[1]:
                    rows = stage[layers.start:layers.stop].view(len(layers), len(ids), *stack.shape[2:])
                    source, rows = _wide(stack, rows)
                    torch.index_select(source, 1, index, out=rows)
                    continue
                for layer in layers:
                    rows = stage[layer, : len(ids)].view(len(ids), *self._runs[layer])
                    source, rows = _wide(self.pages[layer], rows)
                    torch.index_select(source, 0, index, out=rows)
            if count < stage.shape[1]:
                stage[:, count:].zero_()
            chunk.copy_(stage, non_blocking=True)

    def _staging(self) -> torch.Tensor:
        """One chunk's pages on the device, contiguous, made once: gathers fill it before
        one copy to host, whole-chunk scatters take it from host in one copy. Only the side
        stream uses it, so each use follows the one before."""
        if self._stage is None:
            geometry = self.geometry
            self._stage = torch.empty((geometry.num_layers, geometry.blocks_per_chunk,
                                       geometry.page_bytes), dtype=torch.uint8, device=self.device)
        return self._stage

    def bytes_of(self, block_ids: Sequence[int]) -> int:
        """Bytes a load of ``block_ids`` copies (the null block's pages are not)."""
        return sum(len(layers) * sum(1 for b in ids if b != NULL_BLOCK)
                   for layers, ids in self._per_group(block_ids)) * self.geometry.page_bytes

    def mark(self) -> torch.cuda.Event | None:
        """An event on the compute stream now (None on the CPU): what a load started now
        comes after, for its scatter, later, to wait for (``after``), not the forward then."""
        if self._stream is None:
            return None
        return torch.cuda.current_stream(self.device).record_event()

    def scatter(self, slot: torch.Tensor, block_ids: Sequence[int], first: int,
                after: Any = None) -> None:
        """Copy pages ``first ...`` of the chunk in ``slot`` into ``block_ids`` (the null
        block skipped), after ``after`` (``mark``) or else all the compute stream has
        queued so far."""
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
        self._scatter_cuda(groups, chunk, first, after)

    def _scatter_cuda(self, groups: list[tuple[range, Sequence[int]]], chunk: torch.Tensor,
                      first: int, after: Any) -> None:
        """On the side stream: a whole chunk to the device in one copy (the staging chunk),
        part of one a layer's rows at a time; then its pages into place. After what the
        compute stream has queued so far, as a gather is: vLLM zeroes newly allocated
        blocks there before it starts loads (and orders its loads after that), and an
        earlier step's forward may still be writing pages there. An asynchronous load's
        scatter, in a later step, waits only for what came before its start (``after``):
        its blocks are no forward's since (vLLM neither zeroes nor schedules them)."""
        assert self._stream is not None
        self._follow(after)
        whole = first == 0 and bool(groups) and len(groups[0][1]) == chunk.shape[1]
        with torch.cuda.stream(self._stream):
            source = chunk
            if whole:
                source = self._staging()
                source.copy_(chunk, non_blocking=True)
            for (layers, ids), stack in zip(groups, self._stacks, strict=True):
                kept = [i for i, block in enumerate(ids) if block != NULL_BLOCK]
                if not kept:
                    continue
                index, picked = self._ids([ids[i] for i in kept]), self._ids(kept)
                if stack is not None and whole:
                    span = source[layers.start:layers.stop].view(len(layers), len(ids),
                                                                 *stack.shape[2:])
                    if len(kept) < len(ids):
                        span = span.index_select(1, picked)
                    into, span = _wide(stack, span)
                    into.index_copy_(1, index, span)
                    continue
                for layer in layers:
                    span = source[layer, first:first + len(ids)].view(len(ids), *self._runs[layer])
                    if not whole:
                        span = span.to(self.device, non_blocking=True)
                    if len(kept) < len(ids):
                        span = span.index_select(0, picked)
                    into, span = _wide(self.pages[layer], span)
                    into.index_copy_(0, index, span)

    def _follow(self, after: Any) -> None:
        """The side stream's next work after ``after`` (an event), or all the compute stream has queued."""
        assert self._stream is not None
        if after is not None:
            self._stream.wait_event(after)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        """Wait for copies started on the side stream (no-op on the CPU)."""
        if self._stream is not None:
            self._stream.synchronize()


def _wide(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tensors ``a`` and ``b`` (the same shape) seen as 8-byte integers where both can
    be, else as they are: a gather or scatter kernel moves an element per thread, so bytes
    one at a time ran at a fraction of the device's memory speed (115 us a 32 MiB chunk on
    an H200, against a copy's 600 us)."""
    def fits(t: torch.Tensor) -> bool:
        return t.shape[-1] % 8 == 0 and t.data_ptr() % 8 == 0 \
            and all(stride % 8 == 0 for stride in t.stride()[:-1])
    if fits(a) and fits(b):
        return a.view(torch.int64), b.view(torch.int64)
    return a, b


def _stacked(pages: list[torch.Tensor]) -> torch.Tensor | None:
    """``pages`` (each ``(blocks, *runs)`` bytes) as one ``(layers, blocks, *runs)`` view,
    when they are views of one allocation of the same shape and strides, each the same
    distance past the one before it and no two overlapping; else None."""
    first = pages[0]
    if len(pages) < 2 or any(p.shape != first.shape or p.stride() != first.stride()
                             or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                             for p in pages):
        return None
    step = pages[1].data_ptr() - first.data_ptr()
    if step <= 0 or any(p.data_ptr() - first.data_ptr() != i * step for i, p in enumerate(pages)):
        return None
    shape, strides = (len(pages), *first.shape), (step, *first.stride())
    reach = 0  # the furthest byte reached by the dims of smaller strides
    for size, stride in sorted(zip(shape, strides, strict=True), key=lambda d: d[1]):
        if size > 1 and stride <= reach:
            return None  # two elements could share a byte
        reach += (size - 1) * stride
    return first.as_strided(shape, strides)


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
