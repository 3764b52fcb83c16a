"""The KV events the scheduler side hands vLLM each step (``take_events``): what its tiers
gain and lose (``KVEvents``) and, with a disk tier, the chunks on disk named from their
token records (``StorageEvents``): its own disk as found at start, and the segments of
other engines it follows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.chunk_records import ChunkHashing
from kvtier.connector.scheduler.events import KVEvents
from kvtier.connector.scheduler.storage_events import StorageEvents
from kvtier.keys import ChunkKey, Namespace
from kvtier.segment.index_file import SlotLayout
from kvtier.shared.follower import OtherWriters
from kvtier.tiers.base import TierName
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.stack import TierStack


class EventFeed:
    """Contract: ``take()`` returns the events since the last take, oldest first. The
    first take starts reading token records (vLLM hashes blocks only once its engine is
    up): of every chunk the disk tier holds then, and of other writers' chunks, then as
    they come and go. A record's chunk is published as stored on disk (``STORAGE``) while
    this engine's disk or another segment holds it. ``close()`` stops the reads."""

    def __init__(self, events: KVEvents, storage: StorageEvents | None, stack: TierStack,
                 others: OtherWriters | None, counters: Counter) -> None:
        self.events, self._storage, self._stack = events, storage, stack
        self._others, self._counters = others, counters
        self._started = False

    def take(self) -> list[Any]:
        if self._storage is not None:
            if not self._started:
                self._start(self._storage)
            disk = self._stack.indexes.get(TierName.DISK)
            for found in self._storage.drain():
                if found.blocks is None:
                    self.events.shared_gone(found.key)
                else:
                    self.events.found(found.key, found.blocks, shared=found.shared,
                                      on_disk=disk is not None and found.key in disk)
            self._counters["kv_events_unnamed"] = self._storage.unnamed + self._storage.dropped
        return self.events.take()

    def _start(self, storage: StorageEvents) -> None:
        self._started = True
        disk = self._stack.indexes.get(TierName.DISK)
        own = [] if disk is None else _slots(disk)
        storage.start(own, None if self._others is None else self._others.views[0].listen)

    def close(self) -> None:
        if self._storage is not None:
            self._storage.close()


def _slots(index: SlotIndex) -> list[tuple[ChunkKey, int]]:
    keys = index.keys()
    return [(key, slot) for key in keys if (slot := index.slot_of(key)) is not None]


def event_feed(events: KVEvents | None, stack: TierStack, others: OtherWriters | None,
               roots: Sequence[str], namespace: Namespace, own_writer: str | None,
               layout: SlotLayout | None, geometry: KVGeometry, hashing: ChunkHashing | None,
               counters: Counter) -> EventFeed | None:
    """The feed while vLLM's events are on (``events``), else None; records are read only
    with a disk tier (``layout``) and vLLM's hashing."""
    if events is None:
        return None
    storage = None
    if layout is not None and hashing is not None:
        storage = StorageEvents(roots, namespace, own_writer or "", layout.stride, geometry,
                                hashing)
    return EventFeed(events, storage, stack, others, counters)
