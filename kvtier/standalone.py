"""``KVStore``: the tiered store in one process, for use without a serving engine.

    store = KVStore(KVLayout(num_layers=32, kv_heads=8, head_size=128), {"host_capacity": "8GiB"})
    store.put(tokens, kv)                 # kv: (layers, 2, len(tokens), kv_heads * head_size)
    hit = store.lookup(tokens)            # hit.tokens cached, hit.chunks_by_tier
    n = store.get(tokens, out)            # fills out[:, :, :n] and returns n

Bookkeeping runs under one lock; bytes move outside it, so puts and gets from many threads
overlap.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.config import KVTierConfig, load_config
from kvtier.errors import ConfigError, LayoutError
from kvtier.io.buffers import align_up
from kvtier.keys import ChunkKey, token_chunk_keys
from kvtier.layout import KVLayout
from kvtier.store import Location, Move, StorePlan, TierStack
from kvtier.tiers.base import MemoryTier, TierName
from kvtier.tiers.gpu import DevicePool
from kvtier.tiers.host import HostTier
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.policy import make_policy

Tokens = Sequence[int] | np.ndarray


@dataclass(frozen=True)
class PrefixHit:
    """How much of a token sequence is cached: ``tokens`` (whole chunks) and where."""

    tokens: int
    chunks_by_tier: Mapping[TierName, int] = field(default_factory=dict)


@dataclass
class StoreStats:
    """Counters since the store was made."""

    chunks_stored: int = 0
    chunks_skipped: int = 0  # already cached, or no room
    chunks_loaded: Counter = field(default_factory=Counter)  # by tier
    chunks_promoted: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    demotions: int = 0
    drops: int = 0


class KVStore:
    """A tiered KV store: device pool (``gpu_capacity``), then host memory (``host_capacity``).

    Chunks of ``chunk_tokens`` tokens are keyed by their whole prefix, placed in the hottest
    tier, moved down a tier when evicted, and promoted to the hottest tier when read.
    """

    def __init__(
        self,
        layout: KVLayout,
        config: KVTierConfig | Mapping[str, Any] | None = None,
        *,
        model: str = "model",
        device: torch.device | str | None = None,
    ) -> None:
        self.config = config if isinstance(config, KVTierConfig) else load_config(config)
        self.layout = layout
        self.chunk_tokens = self.config.chunk_tokens
        self.namespace = layout.namespace(model, self.chunk_tokens)
        self.chunk_bytes = layout.token_bytes * self.chunk_tokens
        self.slot_bytes = align_up(self.chunk_bytes)
        self._dtype = getattr(torch, layout.dtype)
        self._lock = threading.Lock()
        self.tiers: dict[TierName, MemoryTier] = {}
        if self.config.gpu_capacity >= self.slot_bytes:
            self.tiers[TierName.GPU] = DevicePool(
                self.config.gpu_capacity // self.slot_bytes, self.slot_bytes, device
            )
        if self.config.host_capacity >= self.slot_bytes:
            self.tiers[TierName.HOST] = HostTier(
                self.config.host_capacity // self.slot_bytes, self.slot_bytes
            )
        if not self.tiers:
            raise ConfigError(
                f"kvtier config: host_capacity={self.config.host_capacity} and gpu_capacity="
                f"{self.config.gpu_capacity} hold no chunk of {self.chunk_bytes} bytes "
                f"({self.chunk_tokens} tokens); raise host_capacity or lower chunk_tokens"
            )
        self._stack = TierStack([
            (name, SlotIndex(tier.num_slots, make_policy(self.config.eviction_policy)))
            for name, tier in self.tiers.items()
        ])
        self._top = self._stack.order[0]
        self._stats = StoreStats()

    # -- public API ---------------------------------------------------------------------

    def keys(self, tokens: Tokens) -> list[ChunkKey]:
        """Chunk keys of the full chunks of ``tokens``."""
        return token_chunk_keys(self.namespace, tokens)

    def put(self, tokens: Tokens, kv: torch.Tensor) -> int:
        """Store the KV of every full chunk of ``tokens``; return the tokens newly stored.

        ``kv`` has shape ``(layers, 2, n, kv_heads * head_size)`` with ``n >= len(tokens)``
        rounded down to whole chunks. Chunks already cached are only marked recent.
        """
        keys = self.keys(tokens)
        self._check_tensor(kv, len(keys) * self.chunk_tokens, "kv")
        stored = 0
        for i, key in enumerate(keys):
            with self._lock:
                if self._stack.locate(key) is not None:
                    self._stack.touch(key)
                    plan = None
                else:
                    plan = self._stack.plan_store(key, self._top)
            if plan is None:
                self._count(chunks_skipped=1)
                continue
            self._write(plan, lambda dst, i=i: dst.copy_(self._chunk_of(kv, i)))
            stored += 1
        self._sync()
        self._count(chunks_stored=stored)
        return stored * self.chunk_tokens

    def lookup(self, tokens: Tokens) -> PrefixHit:
        """The longest cached prefix of ``tokens``, in tokens, and its chunks per tier."""
        keys = self.keys(tokens)
        with self._lock:
            match = self._stack.match_prefix(keys)
        counts = Counter(loc.tier for loc in match.locations)
        return PrefixHit(match.num_chunks * self.chunk_tokens, dict(counts))

    def get(self, tokens: Tokens, out: torch.Tensor) -> int:
        """Copy the longest cached prefix of ``tokens`` into ``out``; return its length.

        ``out`` has shape ``(layers, 2, m, kv_heads * head_size)``; at most ``m`` tokens
        (whole chunks) are loaded into ``out[:, :, :n]``. Chunks read from a colder tier are
        promoted to the hottest one.
        """
        self._check_tensor(out, 0, "out")
        keys = self.keys(tokens)[: out.shape[2] // self.chunk_tokens]
        with self._lock:
            match = self._stack.pin_prefix(keys)
        try:
            for i, (key, loc) in enumerate(zip(keys, match.locations, strict=False)):
                source = self._view(loc)
                self._chunk_of(out, i).copy_(source)
                if loc.tier is not self._top:
                    self._promote(key, source)
        finally:
            self._sync()
            with self._lock:
                for key, loc in zip(keys, match.locations, strict=False):
                    self._stack.unpin(key, loc)
                self._stats.chunks_loaded.update(loc.tier for loc in match.locations)
        return match.num_chunks * self.chunk_tokens

    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        with self._lock:
            s = self._stats
            return StoreStats(
                s.chunks_stored, s.chunks_skipped, Counter(s.chunks_loaded), s.chunks_promoted,
                {str(n): i.evictions for n, i in self._stack.indexes.items()},
                self._stack.demotions, self._stack.drops,
            )

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _view(self, loc: Location) -> torch.Tensor:
        """The chunk in ``loc`` as a ``(layers, 2, chunk_tokens, hidden)`` tensor view."""
        raw = self.tiers[loc.tier].slot(loc.slot)[: self.chunk_bytes]
        return raw.view(self._dtype).view(self.layout.shape(self.chunk_tokens))

    def _chunk_of(self, kv: torch.Tensor, i: int) -> torch.Tensor:
        return kv[:, :, i * self.chunk_tokens:(i + 1) * self.chunk_tokens]

    def _write(self, plan: StorePlan, fill) -> None:
        """Run the plan's demotions, then ``fill(dst_view)``; finish every reservation."""
        ok = False
        try:
            for move in plan.demotions:
                self._move(move)
            fill(self._view(plan.dst))
            self._sync()
            ok = True
        finally:
            with self._lock:
                self._stack.finish(plan.key, plan.dst, ok)

    def _move(self, move: Move) -> None:
        ok = False
        try:
            self._view(move.dst).copy_(self._view(move.src))
            self._sync()
            ok = True
        finally:
            with self._lock:
                self._stack.finish(move.key, move.dst, ok)

    def _promote(self, key: ChunkKey, source: torch.Tensor) -> None:
        with self._lock:
            plan = self._stack.plan_store(key, self._top)
        if plan is not None:
            self._write(plan, lambda dst: dst.copy_(source))
            self._count(chunks_promoted=1)

    def _sync(self) -> None:
        gpu = self.tiers.get(TierName.GPU)
        if gpu is not None and gpu.device.type == "cuda":
            torch.cuda.synchronize(gpu.device)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _check_tensor(self, kv: torch.Tensor, min_tokens: int, what: str) -> None:
        want = self.layout.shape(min_tokens)
        if (kv.dim() != 4 or kv.shape[:2] != want[:2] or kv.shape[3] != want[3]
                or kv.shape[2] < min_tokens or kv.dtype != self._dtype):
            raise LayoutError(
                f"{what} must be a {self.layout.dtype} tensor of shape (layers={want[0]}, 2, "
                f"tokens>={min_tokens}, hidden={want[3]}), got {kv.dtype} {tuple(kv.shape)}"
            )
