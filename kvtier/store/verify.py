"""Checking cached chunks against the truth: KV computed now for the same tokens.

A checksum proves a chunk's bytes are the ones written under its key. It cannot prove they
are the right bytes for that key: a chunk written from the wrong pages, another prompt's
chunk under this prompt's key (a writer that mislabels, a page copy bug), a layout that
changed under the same name. Only comparing with a fresh computation does. ``verify`` reads
the cached prefix of ``tokens`` as ``get`` would serve it and compares it, chunk by chunk,
with ``kv``; every chunk that differs is removed from every tier the store reaches (see
``Forget``), counted by the tier it would have been served from, and logged once.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.disk.copies import blank_every_copy
from kvtier.keys import ChunkKey
from kvtier.store.state import StoreState
from kvtier.store.tolerance import within
from kvtier.tiers.base import TierName

log = logging.getLogger("kvtier")
MAX_COPIES = 64  # another writer's copies of one chunk dropped at most (a hostile one may
# name a key in every slot: those past this are found and dropped at their next check)


@dataclass(frozen=True)
class Verified:
    """What ``KVStore.verify_against`` found: ``checked`` chunks compared (the cached prefix
    of the tokens, as far as ``kv`` reaches), ``mismatched`` those whose cached bytes
    differed, by the tier that would have served each; ``removed`` their keys."""

    checked: int
    mismatched: Mapping[TierName, int] = field(default_factory=dict)
    removed: tuple[ChunkKey, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.removed


def same_chunk(cached: torch.Tensor, fresh: torch.Tensor, atol: float,
               tolerance: float | None = None) -> bool:
    """Whether a chunk's cached KV equals the fresh one: with ``tolerance``, every value
    within that share of the largest magnitude of its layer's fresh K or V
    (``tolerance.within``, as the engine's sampled checks compare); else byte for byte
    (``atol`` 0, what a deterministic engine gives), or every value within ``atol``."""
    if tolerance is not None:  # each layer's K and V on its own scale
        return within(cached.flatten(0, 1), fresh.flatten(0, 1), tolerance)
    if atol == 0.0:
        return bool(torch.equal(cached.contiguous().view(torch.uint8),
                                fresh.contiguous().view(torch.uint8)))
    return bool(torch.allclose(cached.float(), fresh.float(), rtol=0.0, atol=atol, equal_nan=True))


def differing(cached: torch.Tensor, fresh: torch.Tensor, chunk_tokens: int, count: int,
              atol: float, tolerance: float | None = None) -> list[int]:
    """The indexes of the first ``count`` chunks (along dim 2) that differ."""
    return [i for i in range(count)
            if not same_chunk(cached[:, :, i * chunk_tokens:(i + 1) * chunk_tokens],
                              fresh[:, :, i * chunk_tokens:(i + 1) * chunk_tokens], atol,
                              tolerance)]


def report(keys: Sequence[ChunkKey], tiers: Sequence[TierName], checked: int,
           wrong: Sequence[int]) -> Verified:
    """The ``Verified`` of chunks ``wrong`` (indexes into ``keys``, served from ``tiers``),
    each logged (the first one a warning, with how to look further)."""
    by_tier = Counter(tiers[i] for i in wrong)
    for i in wrong:
        log.warning("kvtier: chunk %s (from %s) holds KV other than what was computed now for "
                    "its tokens: removed from every tier (kvtier verify checks a cache "
                    "offline)", keys[i].hex()[:16], tiers[i])
    return Verified(checked, dict(by_tier), tuple(keys[i] for i in wrong))


def forget(state: StoreState, keys: Sequence[ChunkKey]) -> None:
    """Remove chunks found wrong from every tier the store reaches: its own (a disk slot's
    header blanked, so no restart finds it again, and its older copies too; a disk write in
    flight is blanked once over instead of committed, ``PlanRunner.finish`` and
    ``DiskWrites``; a copy into memory in flight, a get's read say, is aborted once over:
    ``StoreState.unwanted``), another writer's copies (not read again until that writer writes the
    slot anew: its segment is not the store's to change), and the remote store (removed
    there, for every node; a write in flight, once over)."""
    others, remote = state.others, state.remote
    for key in keys:
        with state.books.held() as b:
            disk = b.stack.indexes[TierName.DISK]
            slot = disk.slot_of(key)  # on disk: held (no chunk put meanwhile lands there)
            if slot is not None:
                disk.hold(key)
            elif disk.has_entry(key):  # being written: its writer blanks it once over
                state.forgotten.add(key)
            for tier in b.stack.order:  # a copy into memory in flight: aborted once over
                index = b.stack.indexes[tier]
                if tier is not TierName.DISK and index.has_entry(key) and index.slot_of(key) is None:
                    state.unwanted.add((key, tier))
            b.stack.discard(key)
        if slot is not None:
            state.lane.invalidate(slot, key)
            with state.books.held() as b:
                disk.unpin(key)  # discarded while held: its slot is free from now
        for _ in range(MAX_COPIES):  # another writer's copies, each found in turn
            refs = others.find(key) if others is not None else None
            if others is None or refs is None:
                break
            others.drop(refs)
    blank_every_copy(state.lane, keys)  # older copies, which a start-up would take
    if remote is not None and keys:
        remote.remove(keys)
