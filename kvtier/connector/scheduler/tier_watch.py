"""The scheduler side's tier stack (``tier_stack``), and ``WatchedIndex``: a tier's index
that tells ``KVEvents`` what the tier gains and loses.

Every way a chunk enters or leaves a tier goes through its index, so events are raised
here and nowhere else: a commit (a store, a write-through or write-back disk write, a disk
chunk kept in host memory after a load), an eviction (the victim of a reservation, whether
it moves down a tier or is dropped), a discard (a failed checksum, a disk path out of
service). Used only while vLLM's KV events are on.
"""

from __future__ import annotations

from collections.abc import Collection

from kvtier.config.settings import KVTierConfig
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.events import KVEvents
from kvtier.io.buffers import align_up
from kvtier.keys import ChunkKey
from kvtier.segment.index_file import SlotLayout
from kvtier.tiers.base import TierName
from kvtier.tiers.index import Reservation, SlotIndex
from kvtier.tiers.policy import EvictionPolicy, make_policy
from kvtier.tiers.stack import TierStack


class WatchedIndex(SlotIndex):
    """A ``SlotIndex`` of tier ``tier`` whose visible keys' comings and goings are told to
    ``events``: ``stored`` at each commit, ``removed`` (and ``left``) when a visible key is
    evicted or discarded, ``left`` when a reservation is aborted."""

    def __init__(self, num_slots: int, policy: EvictionPolicy[ChunkKey], tier: TierName,
                 events: KVEvents) -> None:
        super().__init__(num_slots, policy)
        self.tier, self.events = tier, events

    def commit(self, key: ChunkKey) -> bool:
        if not super().commit(key):
            return False
        self.events.stored(key, self.tier)
        return True

    def reserve(self, key: ChunkKey, spare: Collection[ChunkKey] = (),
                keep: Collection[ChunkKey] = ()) -> Reservation | None:
        reservation = super().reserve(key, spare, keep)
        if reservation is not None and reservation.victim is not None:
            self._gone(reservation.victim)
        return reservation

    def abort(self, key: ChunkKey) -> None:
        super().abort(key)
        self.events.left(key)

    def discard(self, key: ChunkKey) -> bool:  # retire() discards through here too
        visible = super().discard(key)
        if visible:
            self._gone(key)
        return visible

    def _gone(self, key: ChunkKey) -> None:
        self.events.removed(key, self.tier)
        self.events.left(key)


def tier_stack(config: KVTierConfig, geometry: KVGeometry, layout: SlotLayout | None,
               events: KVEvents | None = None) -> TierStack:
    """Host memory's index, then the disk's when there is one (``layout``); with
    ``events``, each a ``WatchedIndex``, and a chunk's record kept while any of them holds
    it (visible or being written)."""
    def index(tier: TierName, slots: int) -> SlotIndex:
        policy = make_policy(config.eviction_policy)
        if events is None:
            return SlotIndex(slots, policy)
        return WatchedIndex(slots, policy, tier, events)

    levels = [(TierName.HOST, index(TierName.HOST,
                                    config.host_capacity // align_up(geometry.chunk_bytes)))]
    if layout is not None:
        levels.append((TierName.DISK, index(TierName.DISK, layout.num_slots)))
    stack = TierStack(levels)
    if events is not None:
        events.still_held = lambda key: any(i.has_entry(key) for i in stack.indexes.values())
    return stack
