"""The connector's worker on a GPU, end to end, without vLLM's engine.

    python scripts/gpu_worker_check.py [--json out/gpu_worker_check.json] [--disk DIR]
    python scripts/gpu_worker_check.py --device cpu --small    # a dry run: the tests run it

kvtier's scheduler side and worker side of one rank, driven step after step in the order
vLLM's GPU model runner calls a connector (``kv_connector_model_runner_mixin``): the step's
plan; newly allocated blocks zeroed on the compute stream; ``start_load_kv`` before the
forward when the step has synchronous loads (host hits), else after its launch; the forward
on the compute stream; ``wait_for_save``; ``get_finished`` and the blocks with load errors,
whose report goes back to the scheduler side. The KV caches are laid out as vLLM's GPU
attention backends lay them out: the six ``KVCacheLayout`` orders of ``[layers, blocks,
heads, tokens, content]`` (pages with tokens outside heads, as FlashAttention keeps them,
and heads outside tokens, as FlashInfer does), MLA's one latent head (``[blocks, tokens,
content]`` tensors) and a hybrid model's two KV cache groups (full attention and a sliding
window) whose layers share allocations, as vLLM's hybrid allocator shares them.

The stand-in forward writes each computed block's pages (random bytes, drawn per request,
block and layer) late on the compute stream (``torch.cuda._sleep`` first), in a CUDA graph
captured once and replayed for every other request (the hooks outside it, as vLLM runs
them), and reads every loaded page back on the compute stream. Checks, for each layout:

1. stores: every chunk stored holds what the forward wrote, though the forward's writes came
   late on the compute stream and the pages were overwritten right after ``wait_for_save``;
2. host hits: every loaded page, as the next forward reads it, byte for byte, though the
   zeroing of the new blocks was queued late on the compute stream before the loads;
3. disk hits after a restart of both sides (asynchronous loads, finished in later steps):
   the same.

Figures, for each layout, in GiB/s of the chunk bytes moved, one run: the store path (pages
to host slots, ``wait_for_save``), the load path from host memory (``start_load_kv``) and
from disk (``start_load_kv`` until ``get_finished`` names every request), against plain
copies of the same bytes between pinned host memory and the device, and against fio reading
the disk directory in chunk-sized I/Os (where fio is not installed, bare O_DIRECT reads from
Python, each chunk hashed: ``kvtier.bench.bare_reads``). Exits 2 on a machine
without a GPU (but with ``--device cpu``), 1 when a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.bare_reads import bare_read_bandwidth
from kvtier.bench.fio import fio_bandwidth, have_fio
from kvtier.bench.naive import drop_page_cache
from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import NULL_BLOCK, StepPlan
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.worker.side import WorkerSide
from kvtier.io.format import HEADER_BYTES

GIB = 2**30
# vLLM's KVCacheLayout members: the physical order of the logical axes [L, B, H, N, C]
ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
          "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
STEP_DEADLINE_S = 120.0


@dataclass(frozen=True)
class Sizes:
    """The shapes of a run: a GPU's (Llama-3-8B's pages, chunks of 32 MiB), or ``SMALL``."""

    layers: int = 32
    heads: int = 8
    block: int = 16
    content: int = 256  # bf16 per token and head: K and V of 128 each
    mla_content: int = 576  # DeepSeek's latent and rope dims
    chunk_tokens: int = 256
    chunks: int = 4  # per request
    requests: int = 8
    rounds: int = 3  # timed host-hit passes (the best is kept)
    late_cycles: int = 20_000_000  # the compute stream's late work: ~10 ms on an H200


SMALL = Sizes(layers=4, heads=2, content=64, mla_content=72, chunk_tokens=32, chunks=2,
              requests=3, rounds=1, late_cycles=0)


@dataclass(frozen=True)
class Case:
    """One KV cache layout: a physical order, MLA's latent head, or a hybrid's two groups."""

    name: str
    order: tuple[int, ...]
    mla: bool = False
    window: int = 0  # tokens of a second, sliding-window group; 0: one group
    apart: bool = False  # one allocation per layer (vLLM's usual case), not one for all


def cases(sizes: Sizes) -> list[Case]:
    return [*(Case(name, order) for name, order in ORDERS.items()),
            Case("LBNHC-apart", ORDERS["LBNHC"], apart=True),
            Case("MLA", ORDERS["LBHNC"], mla=True),
            Case("hybrid", ORDERS["LBNHC"], window=2 * sizes.chunk_tokens)]


class Caches:
    """A case's KV caches on the device, as vLLM's GPU runner allocates them: one allocation
    in the case's order, seen per layer as ``[B, H, N, C]`` (``logical``, in chunk order;
    a hybrid's groups share the allocation layer by layer) and as vLLM hands them to a
    connector (``by_name``: MLA's as ``[B, N, C]``)."""

    def __init__(self, case: Case, sizes: Sizes, device: torch.device, num_blocks: int) -> None:
        heads, content = (1, sizes.mla_content) if case.mla else (sizes.heads, sizes.content)
        groups = 2 if case.window else 1
        per_group = sizes.layers // groups
        shape = (per_group, num_blocks, heads, sizes.block, content)
        if case.apart:  # each layer its own tensor, [B, H, N, C] in the order's B, H, N, C
            allocation = [_allocated(shape[1:], [a - 1 for a in case.order if a], device)
                          for _ in range(per_group)]
        else:
            allocation = list(_allocated(shape, list(case.order), device).unbind(0))
        self.logical = [t for _ in range(groups) for t in allocation]
        names = [f"model.layers.{i}.attn" for i in range(sizes.layers)]
        self.by_name = {name: t[:, 0] if case.mla else t for name, t in zip(names, self.logical, strict=True)}
        tokens_outside = case.order.index(3) < case.order.index(2)
        self.geometry = KVGeometry(
            num_layers=sizes.layers, page_bytes=heads * sizes.block * content * 2,
            block_tokens=sizes.block, hash_block_tokens=sizes.block,
            chunk_tokens=sizes.chunk_tokens, kv_dtype="bfloat16",
            page_shape=f"{sizes.block}x{heads}x{content}xbfloat16",
            group_layers=(per_group, per_group) if case.window else (),
            layer_names=tuple(names),
            group_kinds=("full", f"sliding{case.window}") if case.window else
            ("mla",) if case.mla else ("full",),
            page_order="NHC" if tokens_outside and not case.mla else "HNC")
        self.groups = [range(g * per_group, (g + 1) * per_group) for g in range(groups)]
        self.device = device

    def bytes_of(self, ids: tuple[list[int], ...]) -> int:
        """Page bytes of ``ids`` (each group's blocks), vLLM's null block left out."""
        return sum(len(layers) * sum(1 for b in group if b != NULL_BLOCK)
                   for layers, group in zip(self.groups, ids, strict=True)) \
            * self.geometry.page_bytes


def _stream_that_never_waits(device: torch.device) -> torch.cuda.Stream:
    """A side stream whose ``wait_stream`` does nothing: kvtier's copies made not to wait
    for the compute stream, as a control that the checks see what that does."""

    class NoWait(torch.cuda.Stream):
        def wait_stream(self, stream) -> None:
            return None

    return NoWait(device)


def _allocated(shape: tuple[int, ...], order: list[int], device: torch.device) -> torch.Tensor:
    """Random bf16 bytes laid out in ``order`` (the physical order of ``shape``'s axes),
    seen in ``shape``'s logical order."""
    raw = torch.empty([shape[axis] for axis in order], dtype=torch.bfloat16, device=device)
    raw.view(torch.uint8).random_(0, 256)
    return raw.permute([order.index(axis) for axis in range(len(shape))])


@dataclass
class Request:
    """What the scheduler side reads of vLLM's ``Request``."""

    request_id: str
    num_tokens: int
    block_hashes: list[bytes]


class Compute:
    """The engine's compute stream, running the stand-in forward: late writes and zeroing
    of pages (``torch.cuda._sleep`` first, so that a copy that does not wait for them is
    seen to race them), reads of loaded pages, and the writes as a replayed CUDA graph."""

    def __init__(self, caches: Caches, late_cycles: int) -> None:
        self.caches, self.cuda = caches, caches.device.type == "cuda"
        self.late_cycles = late_cycles if self.cuda else 0
        self._graphs: dict[tuple[int, bool], tuple[Any, torch.Tensor, torch.Tensor]] = {}

    def _late(self) -> None:
        if self.late_cycles:
            torch.cuda._sleep(self.late_cycles)

    def _index(self, ids: list[int]) -> torch.Tensor:
        """``ids`` on the device without a wait: a copy from pageable memory would wait for
        the compute stream, so the late work would be over before what follows it is even
        queued, and nothing would be late any more when kvtier's copies start."""
        host = torch.tensor(ids, dtype=torch.long)
        if not self.cuda:
            return host
        return host.pin_memory().to(self.caches.device, non_blocking=True)

    def write(self, ids: tuple[list[int], ...], content: torch.Tensor, graph: bool,
              late: bool) -> None:
        """Each layer's pages of ``ids`` := ``content`` (``[blocks, layers, H, N, C bytes]``),
        after the late work when ``late``."""
        if graph and self.cuda:
            self._replay(ids, content, late)
            return
        indexes = [self._index(group) for group in ids]  # queued before the late work
        if late:
            self._late()
        self._write(ids, indexes, content)

    def _write(self, ids: tuple[list[int], ...], indexes: list[torch.Tensor],
               content: torch.Tensor) -> None:
        for layers, group, index in zip(self.caches.groups, ids, indexes, strict=True):
            for layer in layers:
                self.caches.logical[layer].view(torch.uint8).index_copy_(
                    0, index, content[: len(group), layer])

    def capture(self, blocks: int, content: torch.Tensor) -> None:
        """The writes of a request of ``blocks`` blocks a group (``content`` its shape) as
        CUDA graphs, late and not, captured once before any step: a capture synchronizes
        the device and empties PyTorch's caches, which must not happen inside a step. The
        static inputs point at vLLM's null block until a replay fills them (a warm-up
        writes junk there, which nothing reads)."""
        if not self.cuda:
            return
        flat = blocks * len(self.caches.groups)
        for late in (False, True):
            index = torch.zeros(flat, dtype=torch.long, device=self.caches.device)
            source = torch.full_like(content, 0x5A)
            self._write_static(index, source, blocks)  # warm-up, outside the capture
            torch.cuda.synchronize(self.caches.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                if late:
                    self._late()
                self._write_static(index, source, blocks)
            self._graphs[flat, late] = (graph, index, source)

    def _replay(self, ids: tuple[list[int], ...], content: torch.Tensor, late: bool) -> None:
        """The write as the graph ``capture`` made: its static inputs filled on the compute
        stream, then the graph replayed there."""
        flat = [b for group in ids for b in group]
        graph, index, source = self._graphs[len(flat), late]
        index.copy_(self._index(flat))
        source.copy_(content)
        graph.replay()

    def _write_static(self, index: torch.Tensor, source: torch.Tensor, per: int) -> None:
        for g, layers in enumerate(self.caches.groups):
            for layer in layers:
                self.caches.logical[layer].view(torch.uint8).index_copy_(
                    0, index[g * per:(g + 1) * per], source[:per, layer])

    def fill(self, ids: tuple[list[int], ...], value: int, late: bool) -> None:
        """Pages of ``ids`` (the null block left out) := ``value``: vLLM's zeroing of newly
        allocated blocks (late), or a later step's forward reusing stored blocks."""
        work = [(layers, self._index(kept)) for layers, group in zip(self.caches.groups, ids,
                                                                     strict=True)
                if (kept := [b for b in group if b != NULL_BLOCK])]
        if late:  # after the indexes are queued: nothing behind the late work waits for it
            self._late()
        for layers, index in work:
            for layer in layers:
                self.caches.logical[layer].view(torch.uint8).index_fill_(0, index, value)

    def read(self, ids: tuple[list[int], ...]) -> list[torch.Tensor]:
        """Each group's layers' pages of ``ids`` as the forward reads them, copied out."""
        out: list[torch.Tensor] = []
        for layers, group in zip(self.caches.groups, ids, strict=True):
            index = self._index([b if b != NULL_BLOCK else 0 for b in group])
            out.extend(self.caches.logical[layer].view(torch.uint8).index_select(0, index)
                       for layer in layers)
        return out

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.caches.device)


class BlockPool:
    """vLLM's free blocks of one case (block 0 is its null block)."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, 0, -1))

    def take(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError(f"the case's KV cache is out of blocks ({count} asked)")
        return [self.free.pop() for _ in range(count)]

    def give(self, ids: tuple[list[int], ...]) -> None:
        self.free.extend(b for group in ids for b in group if b != NULL_BLOCK)


def _hashes(seed: int, count: int) -> list[bytes]:
    return [seed.to_bytes(8, "little") + i.to_bytes(8, "little") + bytes(16)
            for i in range(count)]


class Engine:
    """One rank's two connector sides over ``caches``, driven as vLLM's GPU model runner
    drives them, one ``step`` at a time."""

    def __init__(self, caches: Caches, sizes: Sizes, root: Path, no_wait: bool = False) -> None:
        self.caches, self.sizes, self.root, self.no_wait = caches, sizes, root, no_wait
        self.compute = Compute(caches, sizes.late_cycles)
        self.writing = 0  # disk writes planned and not reported yet
        self.finished: set[str] = set()
        self.invalid: set[int] = set()
        chunk_bytes = caches.geometry.chunk_bytes
        total = sizes.requests * sizes.chunks * chunk_bytes
        (root / "disk").mkdir(mode=0o700, exist_ok=True)
        self.config = load_config({
            "chunk_tokens": sizes.chunk_tokens, "host_capacity": 2 * total + 4 * chunk_bytes,
            "disk_paths": [str(root / "disk")], "disk_min_free": 0,
            "disk_capacity": 2 * sizes.requests * sizes.chunks * (HEADER_BYTES + chunk_bytes),
            "io_threads": 8, "load_policy": "always"}, environ={})
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.open()

    def open(self) -> None:
        geometry = self.caches.geometry
        namespace = geometry.namespace("gpu-worker-check", "", 1, 0)
        self.scheduler = SchedulerSide(self.config, geometry, [namespace], 1)
        self.worker = WorkerSide(self.config, geometry, namespace)
        self.worker.register(self.caches.by_name)
        pages = self.worker.pages
        if self.no_wait and pages is not None and pages._stream is not None:
            pages._stream = _stream_that_never_waits(self.caches.device)  # the control

    def close(self) -> None:
        if self.worker is not None and self.scheduler is not None:
            if not self.worker.close():
                raise RuntimeError("WorkerSide.close did not finish its disk jobs")
            self.scheduler.close()
        self.worker = self.scheduler = None

    @property
    def sides(self) -> tuple[SchedulerSide, WorkerSide]:
        assert self.scheduler is not None and self.worker is not None, "the engine is closed"
        return self.scheduler, self.worker

    def step(self, meta: StepPlan, forward=None, zero=None, sync_loads: bool = False) -> dict:
        """One engine step in the GPU runner's order: ``zero`` (its zeroing of newly allocated
        blocks, on the compute stream), the loads, ``forward`` (the stand-in forward's work
        on the compute stream), ``wait_for_save``, ``get_finished``, the report. Returns
        the seconds ``start_load_kv`` and ``wait_for_save`` took."""
        scheduler, worker = self.sides
        if zero is not None:
            zero()
        started = time.perf_counter()
        if sync_loads:
            worker.start_loads(meta)  # start_load_kv: before the forward it feeds
        loaded = time.perf_counter() - started
        if forward is not None:
            forward()
        if not sync_loads:
            worker.start_loads(meta)  # after the forward's launch
        started = time.perf_counter()
        worker.save(meta)  # wait_for_save
        saved = time.perf_counter() - started
        self.finished |= worker.finished()  # get_finished
        self.invalid |= worker.take_invalid_blocks()
        report = worker.report()
        if report is not None:
            self.writing -= sum(report.disk_written.values()) + sum(report.disk_failed.values())
            scheduler.worker_report(report)  # update_connector_output
        return {"load": loaded, "save": saved}

    def steps_until(self, done, what: str) -> None:
        """Empty steps until ``done()``, as an engine steps while loads and writes run."""
        deadline = time.monotonic() + STEP_DEADLINE_S
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} after {STEP_DEADLINE_S:g} s")
            self.step(self.sides[0].build_meta())
            time.sleep(0.0002)


class Run:
    """The checks and figures of one case."""

    def __init__(self, case: Case, sizes: Sizes, device: torch.device, root: Path,
                 no_wait: bool = False) -> None:
        self.case, self.sizes = case, sizes
        blocks_per_request = -(-(sizes.chunks * sizes.chunk_tokens + 1) // sizes.block)
        groups = 2 if case.window else 1
        num_blocks = 1 + 3 * groups * sizes.requests * blocks_per_request  # stores, two loads
        self.caches = Caches(case, sizes, device, num_blocks)
        self.pool = BlockPool(num_blocks)
        self.engine = Engine(self.caches, sizes, root, no_wait)
        self.blocks = blocks_per_request
        generator = torch.Generator(device=device).manual_seed(len(case.name))
        page = self.caches.logical[0][0].view(torch.uint8).shape  # [H, N, C bytes]
        self.content = [torch.randint(0, 256, (self.blocks, sizes.layers, *page),
                                      dtype=torch.uint8, device=device, generator=generator)
                        for _ in range(sizes.requests)]
        self.tokens = sizes.chunks * sizes.chunk_tokens + 1
        self.loaded_tokens = sizes.chunks * sizes.chunk_tokens
        self._ids = 0
        self.engine.compute.capture(self.blocks, self.content[0])

    def _request(self, r: int) -> Request:
        self._ids += 1
        return Request(f"req-{self._ids}", self.tokens, _hashes(r, self.tokens // self.sizes.block))

    def _blocks(self, end: int) -> tuple[list[int], ...]:
        """A request's blocks per group, after vLLM's allocation of ``end`` computed tokens:
        a sliding window's group keeps none (the null block) before its window."""
        kept = self.caches.geometry.kept_from(end)
        return tuple([NULL_BLOCK] * (first // self.sizes.block)
                     + self.pool.take(self.blocks - first // self.sizes.block)
                     for first in kept[: len(self.caches.groups)])

    def store(self, first: int, count: int, late: bool) -> dict:
        """One step computing the prompts of requests ``first ...`` (every other one's pages
        written by a replayed graph), their chunks stored at ``wait_for_save`` and their
        blocks overwritten right after it; then steps until the disk has them all. ``late``:
        the forward's writes come late on the compute stream; else they are over before
        ``wait_for_save``, which is timed."""
        scheduler, _ = self.engine.sides
        picked = range(first, first + count)
        requests = [self._request(r) for r in picked]
        ids = [self._blocks(0) for _ in requests]
        meta = scheduler.build_meta()
        for request, blocks in zip(requests, ids, strict=True):
            scheduler.plan_stores(request, blocks, request.num_tokens, meta)
        self.engine.writing += sum(1 for s in meta.stores if s.disk_slot is not None)
        compute = self.engine.compute

        def forward() -> None:
            for r, blocks in zip(picked, ids, strict=True):
                compute.write(blocks, self.content[r], graph=r % 2 == 1, late=late)
            if not late:
                compute.synchronize()

        took = self.engine.step(meta, forward)
        for blocks in ids:  # a later step's forward reuses the blocks at once
            compute.fill(blocks, 0xA5, late=False)
        for request in requests:
            scheduler.request_finished(request.request_id)
        self.engine.steps_until(lambda: self.engine.writing <= 0, "disk writes not reported")
        compute.synchronize()
        for blocks in ids:
            self.pool.give(blocks)
        return {"chunks": len(meta.stores), "all_offered": len(meta.stores) == count * self.sizes.chunks,
                "seconds": took["save"], "bytes": len(meta.stores) * self.caches.geometry.chunk_bytes}

    def _match(self, request: Request) -> tuple[int, bool]:
        scheduler, _ = self.engine.sides
        deadline = time.monotonic() + STEP_DEADLINE_S
        while True:
            n, load_async = scheduler.num_new_matched_tokens(request, 0)
            if n is not None:
                return n, load_async
            if time.monotonic() > deadline:
                raise RuntimeError("the scheduler side kept saying: ask again")
            self.engine.step(scheduler.build_meta())

    def load(self, late: bool) -> dict:
        """Every request's prompt again: matched, its blocks allocated (those of synchronous
        loads zeroed on the compute stream, as vLLM zeroes them: late when ``late``, else
        over before the loads, which are timed), loaded, then read by the forward of the
        step that computes its last token; every page compared."""
        scheduler, _ = self.engine.sides
        requests = [self._request(r) for r in range(self.sizes.requests)]
        matched = [self._match(request) for request in requests]
        ids = [self._blocks(n) for n, _ in matched]
        for request, (n, _), blocks in zip(requests, matched, ids, strict=True):
            if n:
                scheduler.plan_load(request, blocks, 0, n)
        meta = scheduler.build_meta()
        now = [blocks for (_, later), blocks in zip(matched, ids, strict=True) if not later]
        waiting = {request.request_id for request, (n, later) in zip(requests, matched,
                                                                     strict=True) if later}
        compute, engine = self.engine.compute, self.engine
        engine.finished.clear()
        engine.invalid.clear()
        got: list[list[torch.Tensor]] = []

        def zero() -> None:
            for blocks in now:
                compute.fill(blocks, 0, late=late)
            if not late:
                compute.synchronize()

        def forward() -> None:
            got.extend(compute.read(blocks) for blocks in ids)

        started = time.perf_counter()
        took = engine.step(meta, forward if not waiting else None, zero, sync_loads=bool(now))
        if waiting:
            engine.steps_until(lambda: waiting <= engine.finished, "loads never finished")
        seconds = took["load"] if not waiting else time.perf_counter() - started
        if waiting:
            engine.step(scheduler.build_meta(), forward)
        compute.synchronize()
        same = all(self._same(r, n, blocks, pages) for r, ((n, _), blocks, pages)
                   in enumerate(zip(matched, ids, got, strict=True)))
        for request, blocks in zip(requests, ids, strict=True):
            scheduler.request_finished(request.request_id)
            self.pool.give(blocks)
        loaded = sum(self.caches.bytes_of(tuple(g[: n // self.sizes.block] for g in blocks))
                     for (n, _), blocks in zip(matched, ids, strict=True))
        return {"hit_tokens": [n for n, _ in matched], "asynchronous": bool(waiting),
                "identical": same and not engine.invalid, "invalid_blocks": len(engine.invalid),
                "load_seconds": seconds, "load_bytes": loaded}

    def _same(self, r: int, n: int, blocks: tuple[list[int], ...],
              pages: list[torch.Tensor]) -> bool:
        """Whether the pages read of request ``r``'s ``n`` loaded tokens are what its
        prompt's forward wrote (a sliding window's group: those it keeps)."""
        if n != self.loaded_tokens:
            return False
        filled = n // self.sizes.block
        read = iter(pages)
        for layers, group in zip(self.caches.groups, blocks, strict=True):
            kept = [i for i, b in enumerate(group[:filled]) if b != NULL_BLOCK]
            for layer in layers:
                page = next(read)
                if not torch.equal(page[kept], self.content[r][kept, layer]):
                    return False
        return True


def copy_ceilings(nbytes: int, piece: int, device: torch.device, rounds: int) -> dict:
    """GiB/s of plain copies of ``nbytes`` in ``piece``-byte copies: device -> pinned host
    memory and back (on the CPU, host to host), the best of ``rounds``."""
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    there = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, (into, source) in {"d2h": (host, there), "h2d": (there, host)}.items():
        best = 0.0
        for _ in range(rounds):
            if cuda:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            for at in range(0, nbytes, piece):
                into[at:at + piece].copy_(source[at:at + piece], non_blocking=cuda)
            if cuda:
                torch.cuda.synchronize(device)
            best = max(best, nbytes / (time.perf_counter() - started) / GIB)
        out[f"copy_{name}_gib_s"] = best
    return out


def disk_ceiling(directory: Path, block: int, size: int) -> dict:
    """What reading ``directory`` in ``block``-byte I/Os can reach: fio's best read (O_DIRECT,
    else buffered where the filesystem refuses it, as kvtier's ``o_direct auto``), or where
    fio is not installed (a GPU machine's image may lack it), 8 threads of bare O_DIRECT
    reads from Python, each chunk hashed as kvtier checks it (``kvtier.bench.bare_reads``)."""
    if have_fio():
        for direct in (True, False):
            try:
                return {"disk_ceiling": "fio", "disk_ceiling_gib_s": max(
                    fio_bandwidth(directory, "read", block, size, depth, direct)
                    for depth in (4, 16))}
            except OSError:
                continue
    elif block % mmap.PAGESIZE == 0:
        try:
            bare = bare_read_bandwidth(directory, block, size, rows=1, prefix_bytes=8 * block,
                                       threads=8, run=8)
            return {"disk_ceiling": "bare reads", "disk_ceiling_gib_s": bare.gib_s}
        except OSError:  # O_DIRECT refused (tmpfs)
            pass
    return {"disk_ceiling": None, "disk_ceiling_gib_s": None}


def run_case(case: Case, sizes: Sizes, device: torch.device, root: Path, ceiling: bool,
             no_wait: bool = False) -> dict:
    """Every check and figure of one layout, in a scratch directory under ``root``: half
    the requests stored with the forward's writes late (checked), half timed; host hits
    loaded once with the zeroing late (checked), then ``rounds`` times timed; disk hits
    after a restart."""
    scratch = Path(tempfile.mkdtemp(prefix=f"{case.name}-", dir=root))
    run = Run(case, sizes, device, scratch, no_wait)
    half = max(1, sizes.requests // 2)
    try:  # the timed store first: the checked one has kvtier's caches warm then too
        stores = [run.store(half, sizes.requests - half, late=False), run.store(0, half, late=True)]
        host = [run.load(late=True)] + [run.load(late=False) for _ in range(sizes.rounds)]
        run.engine.close()
        if device.type == "cuda":  # not in a dry run: it would slow the rest of the machine
            drop_page_cache()
        run.engine.open()  # a restart: host memory empty, the disk's chunks recovered
        disk = run.load(late=False)
    finally:
        run.engine.close()
    timed, best = stores[0], min(host[1:], key=lambda h: h["load_seconds"])
    geometry, total = run.caches.geometry, sum(s["bytes"] for s in stores)
    out: dict[str, Any] = {
        "chunk_tokens": sizes.chunk_tokens, "chunk_bytes": geometry.chunk_bytes,
        "page_bytes": geometry.page_bytes, "chunks": sum(s["chunks"] for s in stores),
        "stores_identical": all(s["all_offered"] for s in stores) and host[0]["identical"],
        "host_hits_identical": all(h["identical"] for h in host),
        "host_hits_asynchronous": best["asynchronous"],
        "disk_hits_identical": disk["identical"] and disk["asynchronous"],
        "store_gib_s": timed["bytes"] / timed["seconds"] / GIB,
        "host_load_gib_s": best["load_bytes"] / best["load_seconds"] / GIB,
        "disk_load_gib_s": disk["load_bytes"] / disk["load_seconds"] / GIB,
    }
    out.update(copy_ceilings(total, geometry.chunk_bytes, device, max(2, sizes.rounds)))
    if ceiling:
        out.update(disk_ceiling(scratch, geometry.chunk_bytes, total))
    out["store_vs_copy"] = out["store_gib_s"] / out["copy_d2h_gib_s"]
    out["host_load_vs_copy"] = out["host_load_gib_s"] / out["copy_h2d_gib_s"]
    if out.get("disk_ceiling_gib_s"):
        out["disk_load_vs_ceiling"] = out["disk_load_gib_s"] / out["disk_ceiling_gib_s"]
    shutil.rmtree(scratch, ignore_errors=True)
    del run
    gc.collect()  # the worker's objects refer to each other: the case's caches go now
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def passed(result: dict) -> bool:
    return all(case["stores_identical"] and case["host_hits_identical"]
               and case["disk_hits_identical"] for case in result["cases"].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a dry run of the same checks on the CPU")
    parser.add_argument("--small", action="store_true", help="small shapes (seconds on a CPU)")
    parser.add_argument("--disk", type=Path, help="the directory the disk tier uses "
                        "(a scratch directory under it; default: the system's temporary one)")
    parser.add_argument("--chunk-tokens", default="", help="chunk sizes, comma-separated "
                        "(the requests scaled to move the same bytes); default: 256 (32 small)")
    parser.add_argument("--cases", default="", help="layouts, comma-separated (default: all)")
    parser.add_argument("--no-wait", action="store_true", help="a control: kvtier's copies "
                        "made not to wait for the compute stream; exits 0 only when the "
                        "store and host-hit checks of every case catch it (CUDA only)")
    parser.add_argument("--no-fio", action="store_true", help="leave the disk's ceiling out "
                        "(fio's read, or bare reads where fio is not installed)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_worker_check: no CUDA GPU on this machine; nothing to check", file=sys.stderr)
        raise SystemExit(2)
    base = SMALL if args.small else Sizes()
    chunk_sizes = [int(c) for c in args.chunk_tokens.split(",") if c] or [base.chunk_tokens]
    root = Path(tempfile.mkdtemp(prefix="kvtier-gpu-worker-", dir=args.disk))
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "cases": {}}
    try:
        for chunk_tokens in chunk_sizes:
            sizes = replace(base, chunk_tokens=chunk_tokens,
                            requests=max(1, base.requests * base.chunk_tokens // chunk_tokens))
            wanted = set(filter(None, args.cases.split(",")))
            for case in cases(sizes):
                if not wanted or case.name in wanted:
                    name = f"{case.name}/{chunk_tokens}"
                    result["cases"][name] = run_case(case, sizes, device, root,
                                                     not args.no_fio, args.no_wait)
                    print(name, json.dumps(result["cases"][name]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    if args.no_wait:  # the control: every case's stores and host hits must be caught
        caught = all(not c["stores_identical"] and not c["host_hits_identical"]
                     for c in result["cases"].values())
        print("gpu_worker_check --no-wait:", "the checks caught the copies that do not wait"
              if caught else "the checks did NOT catch the copies that do not wait")
        raise SystemExit(0 if caught else 1)
    raise SystemExit(0 if passed(result) else 1)


if __name__ == "__main__":
    main()
