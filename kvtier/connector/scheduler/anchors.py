"""Chunks named from token records wait for the chunk before them in their prompt.

A router that indexes prefixes drops a ``BlockStored`` whose parent block it has not seen
from the same engine, and does not take it up when the parent comes later (vllm-router
0.1.17: "unknown parent; skipping unanchored store"; ``tests/test_router_anchors.py``).
Chunks named from records come in no prompt order: a restarted engine's disk is read slot
by slot, other engines' segments as they change, the remote store's log as writes ended.
So a chunk is published only once the chunk whose last block is its parent was.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from kvtier.connector.scheduler.storage_events import Found
from kvtier.keys import ChunkKey

WAITING_LIMIT = 65536  # chunks waiting for their parent; past it the oldest are dropped
SWEEP_EVERY_S = 1.0  # how often the waiting are checked against parents published otherwise


class Anchors:
    """Contract: ``order(found, published)`` returns ``found`` as it may be published now,
    in order: a chunk gone passes at once (and stops waiting); a chunk named passes when
    its parent is None, ``published(parent)`` says this engine published that block
    already, or a chunk passed before it in this call ends with it, and is followed by the
    chunks that waited for it. The others wait, each until its parent passes or
    ``published`` says so (asked at most once every ``SWEEP_EVERY_S``); a chunk named again
    while waiting keeps its latest naming. At most ``limit`` chunks wait: past it the
    oldest are dropped, counted in ``counters["kv_events_dropped"]``."""

    def __init__(self, counters: Counter, limit: int = WAITING_LIMIT) -> None:
        self._counters, self._limit = counters, limit
        self._waiting: OrderedDict[ChunkKey, Found] = OrderedDict()  # oldest first
        self._by_parent: dict[bytes, set[ChunkKey]] = {}
        self._swept = time.monotonic()

    def __len__(self) -> int:
        return len(self._waiting)

    def order(self, found: Iterable[Found], published: Callable[[bytes], bool]) -> list[Found]:
        out: list[Found] = []
        passed: set[bytes] = set()  # last block hashes of the chunks passed in this call
        for item in found:
            self._forget(item.key)
            blocks = item.blocks
            if blocks is None or blocks.parent is None or blocks.parent in passed \
                    or published(blocks.parent):
                self._pass(item, out, passed)
            else:
                self._wait(item, blocks.parent)
        if self._waiting and time.monotonic() - self._swept >= SWEEP_EVERY_S:
            self._swept = time.monotonic()
            for parent in [p for p in self._by_parent if published(p)]:
                for key in list(self._by_parent.get(parent, ())):
                    self._pass(self._forget(key), out, passed)
        return out

    def _pass(self, item: Found | None, out: list[Found], passed: set[bytes]) -> None:
        """``item`` and, after it, every chunk waiting on it (and on those, in turn)."""
        todo = [item] if item is not None else []
        while todo:
            passing = todo.pop()
            out.append(passing)
            if passing.blocks is not None:
                passed.add(passing.blocks.hashes[-1])
                children = self._by_parent.get(passing.blocks.hashes[-1], set())
                todo += [f for key in list(children) if (f := self._forget(key)) is not None]

    def _wait(self, item: Found, parent: bytes) -> None:
        if len(self._waiting) >= self._limit:
            self._forget(next(iter(self._waiting)))
            self._counters["kv_events_dropped"] += 1
        self._waiting[item.key] = item
        self._by_parent.setdefault(parent, set()).add(item.key)

    def _forget(self, key: ChunkKey) -> Found | None:
        item = self._waiting.pop(key, None)
        if item is not None and item.blocks is not None and item.blocks.parent is not None:
            children = self._by_parent.get(item.blocks.parent)
            if children is not None:
                children.discard(key)
                if not children:
                    del self._by_parent[item.blocks.parent]
        return item
