"""Chunks named from token records wait for the chunk before them in their prompt.

A router that indexes prefixes drops a ``BlockStored`` whose parent block it has not seen
from the same engine, and does not take it up when the parent comes later (vllm-router
0.1.17: "unknown parent; skipping unanchored store"; ``tests/test_router_anchors.py``).
Chunks named from records come in no prompt order: a restarted engine's disk is read slot
by slot, other engines' segments as they change, the remote store's log as writes ended.
So a chunk is published only once the chunk whose last block is its parent was: not once
its parent was merely handed on, since a parent may publish nothing (a chunk of this
engine's disk evicted since it was listed).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from kvtier.connector.scheduler.storage_events import Found
from kvtier.keys import ChunkKey

WAITING_LIMIT = 65536  # chunks waiting for their parent; past it the oldest are dropped
SWEEP_EVERY_S = 1.0  # how often the waiting are checked against parents published otherwise

Source = tuple[ChunkKey, bool, bool]  # a chunk and who holds it: (key, shared, remote)


def source(item: Found) -> Source:
    """A naming's place among the waiting: one per chunk and holder (this engine's disk,
    other engines' segments, the remote store), so that one holder's naming or loss never
    replaces or cancels another's."""
    return item.key, item.shared, item.remote


class Anchors:
    """Contract: ``order(found, publish, published)`` hands each of ``found`` to
    ``publish``, in order, as soon as it may be published: a chunk gone at once (and its
    holder's naming stops waiting); a chunk named once its parent is None or
    ``published(parent)`` (the router holds that block once this engine's events waiting
    are taken, so that a chunk queued now follows it). After
    each chunk ``publish`` made published, the chunks waiting for it follow (and theirs, in
    turn). The others wait, each until its parent is published, by this call or otherwise
    (``published`` asked again at most once every ``SWEEP_EVERY_S``); a holder's chunk
    named again while waiting keeps its latest naming. At most ``limit`` namings wait: past
    it the oldest are dropped, counted in ``counters["kv_events_dropped"]``."""

    def __init__(self, counters: Counter, limit: int = WAITING_LIMIT) -> None:
        self._counters, self._limit = counters, limit
        self._waiting: OrderedDict[Source, Found] = OrderedDict()  # oldest first
        self._by_parent: dict[bytes, set[Source]] = {}
        self._swept = time.monotonic()

    def __len__(self) -> int:
        return len(self._waiting)

    def order(self, found: Iterable[Found], publish: Callable[[Found], None],
              published: Callable[[bytes], bool]) -> None:
        for item in found:
            self._forget(source(item))
            blocks = item.blocks
            if blocks is None or blocks.parent is None or published(blocks.parent):
                self._pass(item, publish, published)
            else:
                self._wait(item, blocks.parent)
        if self._waiting and time.monotonic() - self._swept >= SWEEP_EVERY_S:
            self._swept = time.monotonic()
            for parent in [p for p in self._by_parent if published(p)]:
                for waiting in list(self._by_parent.get(parent, ())):
                    self._pass(self._forget(waiting), publish, published)

    def _pass(self, item: Found | None, publish: Callable[[Found], None],
              published: Callable[[bytes], bool]) -> None:
        """``item`` and, once it is published, every chunk waiting on it (and on those)."""
        todo = [item] if item is not None else []
        while todo:
            passing = todo.pop()
            publish(passing)
            last = passing.blocks.hashes[-1] if passing.blocks is not None else None
            if last is not None and last in self._by_parent and published(last):
                todo += [f for waiting in list(self._by_parent[last])
                         if (f := self._forget(waiting)) is not None]

    def _wait(self, item: Found, parent: bytes) -> None:
        if len(self._waiting) >= self._limit:
            self._forget(next(iter(self._waiting)))
            self._counters["kv_events_dropped"] += 1
        self._waiting[source(item)] = item
        self._by_parent.setdefault(parent, set()).add(source(item))

    def _forget(self, where: Source) -> Found | None:
        item = self._waiting.pop(where, None)
        if item is not None and item.blocks is not None and item.blocks.parent is not None:
            children = self._by_parent.get(item.blocks.parent)
            if children is not None:
                children.discard(where)
                if not children:
                    del self._by_parent[item.blocks.parent]
        return item
