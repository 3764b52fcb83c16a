"""The KV events the scheduler side hands vLLM each step (``take_events``): what its tiers
gain and lose (``KVEvents``); with a disk tier, the chunks on disk named from their token
records (``StorageEvents``): its own disk as found at start, and the segments of other
engines it follows; with a remote store that keeps a log of token records, the store's
chunks (``RemoteEvents``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.anchors import Anchors
from kvtier.connector.scheduler.chunk_records import ChunkHashing
from kvtier.connector.scheduler.events import KVEvents
from kvtier.connector.scheduler.remote_events import RemoteEvents
from kvtier.connector.scheduler.remote_presence import RemotePresence
from kvtier.connector.scheduler.storage_events import Found, StorageEvents
from kvtier.keys import ChunkKey, Namespace
from kvtier.segment.index_file import SlotLayout
from kvtier.shared.follower import OtherWriters
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import TierStack

TAKE_LIMIT = 1024  # chunks found from records handed on a take (a step), at most


class EventFeed:
    """Contract: ``take()`` returns the events since the last take, oldest first. The
    first take starts reading token records (vLLM hashes blocks only once its engine is
    up): of every chunk the disk tier holds then, and of other writers' chunks, then as
    they come and go. A record's chunk is published as stored on disk (``STORAGE``) while
    this engine's disk or another segment holds it, once the chunk before it in its prompt
    was (``Anchors``). ``remote_lost(keys)``: the remote store is known to have lost
    ``keys``: their removal is published at once. ``close()`` stops the reads."""

    def __init__(self, events: KVEvents, storage: StorageEvents | None,
                 remote: RemoteEvents | None, stack: TierStack, others: OtherWriters | None,
                 counters: Counter) -> None:
        self.events, self._storage, self._remote, self._stack = events, storage, remote, stack
        self._others, self._counters = others, counters
        self._anchors = Anchors(counters)
        self._started = False

    def take(self) -> list[Any]:
        if not self._started:
            self._start()
        self._anchors.order(self._found(), self._publish, self.events.published)
        return self.events.take()

    def adopted(self, own: Sequence[tuple[ChunkKey, int]]) -> None:
        """Chunks ``own`` (key, disk slot) of a disk path back after being out since the
        start joined the disk tier: their records are read as the start's were (once the
        reads began; before, the first take lists them with the rest of the tier)."""
        if self._storage is not None and self._storage.started:
            self._storage.add_own(own)

    def reset(self, router_told: bool = True) -> None:
        """vLLM's cache reset: nothing held now is told again. The events forget every chunk
        (``KVEvents.clear``; unless ``router_told``, by vLLM's ``AllBlocksCleared``, the
        router is told their removal), and the reads of token records stop: chunks on disk
        and in the remote store from before, this engine's or another's, are never loaded
        again."""
        self.close()
        self._storage = self._remote = None
        self._anchors = Anchors(self._counters)
        self.events.clear(router_told)

    def remote_lost(self, keys: Iterable[ChunkKey]) -> None:
        """The engine learnt that the remote store lost ``keys`` (a read of them answered
        missing or damaged, or a sampled check removed them as wrong): the removal of each
        published is queued now (a naming waiting for its parent is dropped), and the remote
        events forget them, so that a later entry of the log names them again."""
        if self._remote is None:
            return
        keys = list(keys)
        self._anchors.order([Found(key, None, False, remote=True) for key in keys],
                            self._publish, self.events.published)
        self._remote.lost(keys)

    def _publish(self, found: Found) -> None:
        if found.remote:
            if found.blocks is None:
                self.events.remote_gone(found.key)
            else:
                self.events.found_remote(found.key, found.blocks)
        elif found.blocks is None:
            self.events.shared_gone(found.key)
        else:
            disk = self._stack.indexes.get(TierName.DISK)
            self.events.found(found.key, found.blocks, shared=found.shared,
                              on_disk=disk is not None and found.key in disk)

    @property
    def waiting(self) -> int:
        """Chunks named but held back until the chunk before them is published."""
        return len(self._anchors)

    def _found(self) -> list[Found]:
        """What the sources found, at most ``TAKE_LIMIT`` a take (shared between them), so
        that a backlog (an idle engine's) costs each step little."""
        found, unnamed = [], 0
        share = TAKE_LIMIT // 2 if self._storage and self._remote else TAKE_LIMIT
        if self._storage is not None:
            found += self._storage.drain(share)
            unnamed += self._storage.unnamed + self._storage.dropped
        if self._remote is not None:
            found += self._remote.drain(share)
            unnamed += self._remote.unnamed
        self._counters["kv_events_unnamed"] = unnamed
        return found

    def _start(self) -> None:
        """Start each source's thread not started yet; started once all are (a thread
        refused: tried again at the next call)."""
        storage = self._storage is None or self._storage.started
        if not storage and self._storage is not None:
            disk = self._stack.indexes.get(TierName.DISK)
            own = [] if disk is None else disk.visible()  # one pass here; the rest on its thread
            storage = self._storage.start(
                own, None if self._others is None else self._others.views[0].listen)
        remote = self._remote is None or self._remote.started or self._remote.start()
        self._started = storage and remote

    def close(self) -> None:
        for source in (self._storage, self._remote):
            if source is not None:
                source.close()


def event_feed(events: KVEvents | None, stack: TierStack,
               peers: tuple[OtherWriters | None, RemotePresence | None], roots: Sequence[str],
               namespace: Namespace, own_writer: str | None, layout: SlotLayout | None,
               geometry: KVGeometry, hashing: ChunkHashing | None,
               counters: Counter) -> EventFeed | None:
    """The feed while vLLM's events are on (``events``), else None. With vLLM's hashing,
    records are read with a disk tier (``layout``; ``peers``' followed segments too) and
    with a remote store that keeps a log of them (``peers``' presence)."""
    if events is None:
        return None
    others, presence = peers
    storage = remote = None
    if layout is not None and hashing is not None:
        storage = StorageEvents(roots, namespace, own_writer or "", layout.stride, geometry,
                                hashing)
    if presence is not None and presence.tiers[0].keeps_records and hashing is not None:
        remote = RemoteEvents(presence.tiers[0], namespace, geometry, hashing)
    feed = EventFeed(events, storage, remote, stack, others, counters)
    if presence is not None and remote is not None:
        presence.on_gone = feed.remote_lost
    return feed
