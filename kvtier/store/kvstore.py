"""``KVStore``: the tiered store in one process, for use without a serving engine.

    store = KVStore(KVLayout(num_layers=32, kv_heads=8, head_size=128), {"host_capacity": "8GiB"},
                    model="meta-llama/Llama-3.1-8B")
    store.put(tokens, kv)                 # kv: (layers, 2, len(tokens), kv_heads * head_size)
    hit = store.lookup(tokens)            # hit.tokens cached, hit.chunks_by_tier
    n = store.get(tokens, out)            # fills out[:, :, :n] and returns n

Bookkeeping runs under one lock (``Books``); bytes move outside it, so puts and gets from many threads
overlap. Disk writes run in the background on the I/O engine; disk reads of one ``get`` run
in parallel.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.config.settings import KVTierConfig, load_config
from kvtier.disk.tier import DiskTier
from kvtier.io.buffers import align_up
from kvtier.io.direct_buffer import DirectBuffers
from kvtier.io.engine import CLOSE_TIMEOUT_S, EngineFactory, IOEngine
from kvtier.io.populate import populating
from kvtier.keys import ChunkKey, token_chunk_keys
from kvtier.layout import KVLayout
from kvtier.logs import apply_log_level
from kvtier.metrics import MetricsServer, Sample, serve_metrics
from kvtier.shared.followed import WriterState
from kvtier.store.assembly import StoreShape, open_parts
from kvtier.store.checks import check_layout, model_name
from kvtier.store.chunk_runs import ChunkRuns
from kvtier.store.direct import DirectTarget, claim, empty_kv
from kvtier.store.flush import FlushResult
from kvtier.store.gate import CallGate
from kvtier.store.get import PrefixRead
from kvtier.store.puts import put_chunks
from kvtier.store.stats import StoreStats, store_samples
from kvtier.store.verify import Verified, differing, forget, report
from kvtier.tiers.base import MemoryTier, TierName
from kvtier.tiers.prefix import walk_remote
from kvtier.units import time_left

Tokens = Sequence[int] | np.ndarray
log = logging.getLogger("kvtier")


@dataclass(frozen=True)
class PrefixHit:
    """How much of a token sequence is cached: ``tokens`` (whole chunks) and where."""

    tokens: int
    chunks_by_tier: Mapping[TierName, int] = field(default_factory=dict)


class KVStore:
    """A tiered KV store: device pool (``gpu_capacity``), host memory (``host_capacity``),
    then disk (``disk_paths``, ``disk_capacity``), then a remote store (``remote_url``).

    Chunks of ``chunk_tokens`` tokens are keyed by their whole prefix, placed in the hottest
    tier, moved down a tier when evicted, and promoted to the hottest tier when read. With
    ``write_through`` every chunk that reaches host memory is also written to disk in the
    background (dropped, and counted, when the disk queue is full); with ``write_back`` a
    chunk is written when host memory evicts it. Chunks on disk survive restarts. With a
    remote store, chunks that reach host memory are written to it in the background (with
    ``remote_min_hits``, once loaded that often), and chunks cached nowhere here are looked
    for there (one round trip per ``lookup`` or ``get``) and read into host memory.

    ``io_engine`` builds the disk's I/O engine (an ``IOExecutor``; tests pass one that can
    hold or fail jobs).
    """

    def __init__(self, layout: KVLayout, config: KVTierConfig | Mapping[str, Any] | None = None,
                 *, model: str | None = None, device: torch.device | str | None = None,
                 io_engine: EngineFactory = IOEngine) -> None:
        check_layout(layout)
        self.config = cfg = config if isinstance(config, KVTierConfig) else load_config(config)
        apply_log_level()
        self.layout = layout
        self.chunk_tokens = cfg.chunk_tokens
        self.namespace = layout.namespace(model_name(model, cfg), self.chunk_tokens)
        self.chunk_bytes = layout.token_bytes * self.chunk_tokens
        self.slot_bytes = align_up(self.chunk_bytes)
        self._gate = CallGate()  # the calls in flight, and whether close() has begun
        self._direct = DirectBuffers()
        self._metrics: MetricsServer | None = None
        shape = StoreShape(cfg, layout, self.namespace, self.chunk_bytes, self.slot_bytes)
        self._parts = parts = open_parts(shape, device, io_engine)
        assert parts.state is not None and parts.runner is not None
        assert parts.fetcher is not None and parts.flusher is not None
        self.tiers: dict[TierName, MemoryTier] = parts.tiers
        self._lane = parts.lane
        self._state, self._books = parts.state, parts.state.books
        self._runner, self._fetcher, self._flusher = parts.runner, parts.fetcher, parts.flusher
        self._read_ahead = parts.read_ahead
        if cfg.metrics_port:
            try:  # a failed start must not keep memory, files or the namespace lock
                self._metrics = serve_metrics(cfg.metrics_port, self.metric_samples, cfg.metrics_host)
            except BaseException:
                parts.release()
                raise

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier (None without ``disk_paths``), for inspection."""
        return self._lane.tier

    # -- public API ---------------------------------------------------------------------

    def keys(self, tokens: Tokens) -> list[ChunkKey]:
        """Chunk keys of the full chunks of ``tokens`` (``TokenError`` unless they are
        integers in int64's range)."""
        self._gate.check()
        return token_chunk_keys(self.namespace, tokens)

    def put(self, tokens: Tokens, kv: torch.Tensor) -> int:
        """Store the KV of every full chunk of ``tokens``; return the tokens newly stored.

        ``kv`` has shape ``(layers, 2, n, kv_heads * head_size)`` with ``n >= len(tokens)``
        rounded down to whole chunks. Chunks already cached are only marked recent. At most
        as many chunks as the largest tier holds are stored (a longer prefix would lose its
        own first chunks to the put or to the gets that promote them); those past it count
        in ``chunks_skipped``.
        """
        with self._gate:
            keys = self.keys(tokens)
            self.layout.check_tensor(kv, len(keys) * self.chunk_tokens, "kv")
            self._poll()
            stored = put_chunks(self._state, self._runner, keys,
                                ChunkRuns(kv, self.chunk_tokens, len(keys)).run,
                                self._drain_timeout())
            self._books.count("chunks_stored", stored)
            return stored * self.chunk_tokens

    def _poll(self) -> None:
        """Every call: disk paths due a retry are tried again (in the background), a write
        stalled past ``load_timeout`` counts against its path, paths taken out by a check
        of their own (their lease, stalls) are retired, and their waiting writes failed."""
        self._lane.poll()
        self._runner.disk_writes.count_stalled(self.config.load_timeout)
        self._books.retire_down_paths()
        self._runner.disk_writes.fail_waiting(self._lane.down_paths)

    def _drain_timeout(self) -> float:
        timeout = self.config.load_timeout
        return 30.0 if timeout is None else min(30.0, timeout)

    def lookup(self, tokens: Tokens) -> PrefixHit:
        """The longest cached prefix of ``tokens``, in tokens, and its chunks per tier."""
        with self._gate:
            self._poll()
            tiers = self._tiers(self.keys(tokens))
            return PrefixHit(len(tiers) * self.chunk_tokens, dict(Counter(tiers)))

    def _tiers(self, keys: list[ChunkKey]) -> list[TierName]:
        """The tier each chunk of the cached prefix of ``keys`` is in (the remote store
        asked in one round trip for the chunks past those held here)."""
        others, remote = self._state.others, self._state.remote
        theirs = others.find if others else None
        found = self._books.cached(keys, theirs)
        past = walk_remote(keys[len(found):], remote.held if remote else None,
                           lambda key: self._books.find(key, theirs))
        return [where.tier for where in [*found, *(past or ())]]

    def verify_against(self, tokens: Tokens, kv: torch.Tensor, atol: float = 0.0, *,
                       tolerance: float | None = None) -> Verified:
        """Check the cached prefix of ``tokens`` against ``kv``, their KV computed now (shaped
        as ``put``'s, as far as it reaches): a chunk whose cached KV differs (a byte; more
        than ``atol``; or, with ``tolerance``, more than that share of the fresh chunk's
        largest value, as vLLM's sampled checks compare) is removed from every tier the
        store reaches and counted (``verify_mismatches`` by the tier that would have served
        it). See ``verify.py``."""
        self.layout.check_tensor(kv, 0, "kv")
        keys = self.keys(tokens)[: kv.shape[2] // self.chunk_tokens]
        with self._gate:
            tiers = self._tiers(keys)
        end = len(tiers) * self.chunk_tokens
        cached = torch.empty_like(kv[:, :, :end], memory_format=torch.contiguous_format)
        checked = self.get(tokens[:end], cached) // self.chunk_tokens
        wrong = differing(cached, kv, self.chunk_tokens, checked, atol, tolerance)
        with self._gate:
            forget(self._state, [keys[i] for i in wrong])
            self._books.verified(checked, [tiers[i] for i in wrong])
        return report(keys, tiers, checked, wrong)

    def get(self, tokens: Tokens, out: torch.Tensor) -> int:
        """Copy the longest cached prefix of ``tokens`` into ``out``; return its length.

        ``out`` has shape ``(layers, 2, m, kv_heads * head_size)``; at most ``m`` tokens
        (whole chunks) are loaded into ``out[:, :, :n]``. Disk chunks are read in parallel
        and verified; a chunk that fails its check ends the prefix there and is dropped.
        Chunks read from a colder tier are promoted to the hottest one; into a tensor from
        :meth:`empty_kv`, a chunk's first read from disk lands in ``out`` directly and it is
        promoted on its next read. ``out[:, :, n:]`` may have been written.
        """
        with self._gate:
            keys = self.keys(tokens)
            self.layout.check_tensor(out, 0, "out")
            self._poll()
            keys = keys[: out.shape[2] // self.chunk_tokens]
            runs = ChunkRuns(out, self.chunk_tokens, len(keys), into=True)
            # a second get into these bytes waits (only disk reads detach pages)
            with claim(self._direct, out) if self.disk else nullcontext():
                direct = DirectTarget.of(out, self._direct, self.chunk_tokens) if self.disk else None
                read = PrefixRead(self._state, self._fetcher, self._runner, self._read_ahead,
                                  self._drain_timeout(), direct)
                return read.run(keys, populating(runs.run)) * self.chunk_tokens

    def empty_kv(self, num_tokens: int) -> torch.Tensor:
        """A ``(layers, 2, num_tokens, hidden)`` CPU tensor (zeros) that ``get`` reads disk
        chunks straight into, with no copy through host memory. Reuse it across gets, as
        its pages are faulted in once; its memory is freed with the last view of it."""
        self._gate.check()
        return empty_kv(self._direct, self.layout, num_tokens)

    def flush(self, timeout: float | None = None) -> FlushResult:
        """Write every chunk held in host memory or the device pool (from a copy of its
        own, not a host slot) not on disk yet (dropped write-through writes and write-back
        chunks not evicted yet included), wait for every disk write, then sync each disk path
        (a power loss keeps what it holds), at most ``timeout`` seconds. True when every chunk
        held is on disk; ``not_written`` says how many are not (disk full or failing, a hung
        drive), ``not_synced`` on how many paths the sync failed. With a remote store, host
        chunks it is not known to hold are written to it too (those its back-pressure
        dropped, refused or lost), and every write to it is waited for (within the same
        ``timeout``): ``remote_not_written`` counts those it does not hold;
        without a disk tier, true when those writes are over and no chunk is held only in
        the device pool. With neither, nothing outlives the process: ``not_written``
        counts every chunk held, and the result is false once one is."""
        with self._gate:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._poll()
            result = self._flusher.flush(timeout)
            remote = self._state.remote
            return result if remote is None else result.with_remote(remote.flush(deadline))

    def stats(self) -> StoreStats:
        """A snapshot of the counters (after ``close`` too: the last ones)."""
        others, remote = self._state.others, self._state.remote
        return self._books.snapshot(bool(self.config.disk_paths),
                                    None if others is None else others.counts(),
                                    None if remote is None else remote.tier.health())

    def writers(self) -> list[WriterState]:
        """The other writers of this store's namespace on its disk paths, as last seen
        (empty without a disk tier or with ``share_refresh`` off; after ``close``, as last
        seen before it)."""
        others = self._state.others
        return others.writers() if others is not None else []

    def metric_samples(self) -> list[Sample]:
        """The store's metrics (what ``metrics_port`` serves; after ``close`` too)."""
        stats = self.stats()
        slots, used = self._books.census(bool(self.config.disk_paths))
        # engine jobs, and the chunks waiting to go to the disk together in a write job
        remote = self._state.remote
        queued = self._lane.pending() + self._runner.disk_writes.writes_waiting
        return store_samples(stats, slots, used, queued,
                             remote=None if remote is None else (remote.backend,
                                                                 remote.lane.puts_pending),
                             shared=self._state.others is not None)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Finish background writes and release memory, files and threads; True when done.

        No call is let in from now on (``StoreClosedError``); calls in other threads already
        inside are waited for, then disk jobs, at most ``timeout`` seconds in all. Jobs
        still running then (a hung drive) are left behind: queued ones are cancelled (a call
        waiting on one raises ``StoreClosedError``), and the host memory and disk files the
        running ones, or calls still inside, use stay open until the process exits, or a
        later ``close`` (False is returned). A second ``close`` meanwhile waits for the
        first (within its own ``timeout``), then finishes what is left.
        """
        deadline = time.monotonic() + timeout
        if not self._gate.closing(timeout):
            return False  # another close() is still at it
        try:
            return self._close(deadline, timeout)
        finally:
            self._gate.closed_by_me()

    def _close(self, deadline: float, timeout: float) -> bool:
        self._gate.close(time_left(deadline))  # the calls inside leave; none comes in
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        return self._parts.close(deadline, self._gate, timeout)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
