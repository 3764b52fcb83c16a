"""The tier stack: bookkeeping across tiers, hottest first. Never touches bytes.

It answers "how long a prefix is cached, and where", plans where a new chunk goes and which
victims move down to make room, and tracks pins. A caller (the standalone store, or the vLLM
connector's scheduler side) moves the bytes as planned and reports each outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierName
from kvtier.tiers.index import SlotIndex


@dataclass(frozen=True)
class Location:
    """A slot in a tier."""

    tier: TierName
    slot: int


@dataclass(frozen=True)
class Move:
    """Copy chunk ``key`` from ``src`` into the reserved ``dst``; then ``finish(key, dst, ok)``."""

    key: ChunkKey
    src: Location
    dst: Location


@dataclass(frozen=True)
class StorePlan:
    """Where to write chunk ``key`` (``dst``, reserved) and what must move first.

    Run ``demotions`` in order (each moves a victim out of a slot about to be reused, down a
    tier), finishing each, then write the chunk into ``dst`` and ``finish(key, dst, ok)``.
    """

    key: ChunkKey
    dst: Location
    demotions: tuple[Move, ...] = ()


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix: one location per chunk, the hottest tier holding it."""

    locations: tuple[Location, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.locations)

    def chunks_in(self, tier: TierName) -> int:
        return sum(loc.tier is tier for loc in self.locations)


class TierStack:
    """Tiers' indexes, hottest first, and the rules that move chunks between them.

    Contract:

    - ``match_prefix(keys)`` is the longest run ``keys[:n]`` whose every key is visible in
      some tier, each with its hottest location. It pins nothing.
    - ``pin_prefix(keys, tier=None)`` pins the hottest locations of that match (with
      ``tier``: the copy in ``tier`` of each chunk of the match that has one there, hottest
      or not) and returns the ``(key, location)`` pairs pinned; ``unpin`` each.
    - ``plan_store(key, tier)`` reserves a slot for ``key`` in ``tier``, or returns ``None``
      when the key is already there (visible or being written) or no slot can be freed. A
      victim evicted to make room is planned to move one tier down, or past a tier with no
      room to the next one with room (a device pool's victim straight to disk while every
      host slot is held by a write), unless a tier on the way already holds it; with no room
      below it is dropped and counted in ``drops``. A victim bound for the disk tier is
      dropped, uncounted, when ``on_disk_elsewhere(victim)`` says a disk copy outside the
      stack serves it (another writer's segment of a shared directory). Each disk slot
      reserved is told to ``on_disk_reserved(slot)``, in the order they are planned.
    - ``finish(key, dst, ok)`` ends each reservation: visible on success, freed on failure.
    - Not thread-safe: the owner holds one lock around calls; bytes move outside the lock,
      which is safe because reserved slots are invisible and pinned ones are never evicted.
    """

    def __init__(self, levels: Sequence[tuple[TierName, SlotIndex]]) -> None:
        self.order: tuple[TierName, ...] = tuple(name for name, _ in levels)
        self.indexes: dict[TierName, SlotIndex] = dict(levels)
        if len(self.indexes) != len(levels):
            raise ValueError(f"tier listed twice in {self.order}")
        self.drops = 0
        self.demotions = 0
        self.on_disk_elsewhere: Callable[[ChunkKey], bool] | None = None
        self.on_disk_reserved: Callable[[int], None] | None = None
        self.on_discard: Callable[[ChunkKey], None] | None = None  # told each key discarded

    def locate(self, key: ChunkKey) -> Location | None:
        """The hottest visible location of ``key``."""
        for name in self.order:
            slot = self.indexes[name].slot_of(key)
            if slot is not None:
                return Location(name, slot)
        return None

    def match_prefix(self, keys: Sequence[ChunkKey]) -> PrefixMatch:
        locations = []
        for key in keys:
            location = self.locate(key)
            if location is None:
                break
            locations.append(location)
        return PrefixMatch(tuple(locations))

    def pin_prefix(self, keys: Sequence[ChunkKey],
                   tier: TierName | None = None) -> list[tuple[ChunkKey, Location]]:
        pinned: list[tuple[ChunkKey, Location]] = []
        if tier is not None and tier not in self.indexes:
            return pinned
        for key, hottest in zip(keys, self.match_prefix(keys).locations, strict=False):
            if tier is None or hottest.tier is tier:
                self.indexes[hottest.tier].pin(key)
                pinned.append((key, hottest))
            else:
                slot = self.indexes[tier].pin(key)  # a colder copy: None when there is none
                if slot is not None:
                    pinned.append((key, Location(tier, slot)))
        return pinned

    def unpin(self, key: ChunkKey, location: Location) -> None:
        self.indexes[location.tier].unpin(key)

    def touch(self, key: ChunkKey) -> None:
        for index in self.indexes.values():
            index.touch(key)

    def plan_store(self, key: ChunkKey, tier: TierName, spare: Collection[ChunkKey] = (),
                   keep: Collection[ChunkKey] = ()) -> StorePlan | None:
        """A slot of ``tier`` for ``key``, its victim moved down (``_plan_demotion``); victims
        are taken outside ``spare`` (a read's next chunks) in every tier while there are any,
        and never from ``keep`` (a get's chunks, which its promotions must not cost: one
        moved down may find no room below, and be dropped)."""
        reservation = self.indexes[tier].reserve(key, spare, keep)
        if reservation is None:
            return None
        dst = Location(tier, reservation.slot)
        if tier is TierName.DISK and self.on_disk_reserved is not None:
            self.on_disk_reserved(reservation.slot)
        victim = reservation.victim
        if victim is None:
            return StorePlan(key, dst)
        return StorePlan(key, dst, self._plan_demotion(victim, dst, spare, keep))

    def costs_spare(self, key: ChunkKey, tier: TierName, spare: Collection[ChunkKey]) -> bool:
        """Whether ``plan_store(key, tier, spare)`` (the slot a get's read lands in;
        ``spare``: the get's later chunks, evicted last) could make room only by evicting one
        of ``spare`` that would find no room below outside them: a read must not cost a
        later chunk of the same get its only copy."""
        free, outside = self.indexes[tier].peek(spare, key)
        if free or outside is not None:
            return False
        _, victim = self.indexes[tier].peek((), key)
        return victim is not None and not self._room_below(victim, tier, spare)

    def plan_promotion(self, key: ChunkKey, tier: TierName,
                       keep: Collection[ChunkKey]) -> StorePlan | None:
        """``plan_store`` for a copy that only speeds later reads (a get's promotion), or
        none where it would cost another chunk its only copy: its victim finding no room
        below but in ``keep``'s slots, where ``_plan_demotion`` would drop it. Evicting from
        the lowest tier in service is eviction as usual, not such a cost."""
        free, victim = self.indexes[tier].peek(keep, key)
        if not free and victim is not None and not self._room_below(victim, tier, keep):
            return None
        return self.plan_store(key, tier, keep=keep)

    def _room_below(self, victim: ChunkKey, tier: TierName, keep: Collection[ChunkKey]) -> bool:
        """True when ``_plan_demotion`` of ``victim`` out of ``tier`` would keep it (a copy
        below already, or a slot below whose own victim is kept in turn), or ``tier`` is the
        lowest with slots in service."""
        lower_tiers = self.order[self.order.index(tier) + 1:]
        if not any(self.indexes[lower].in_service for lower in lower_tiers):
            return True
        for lower in lower_tiers:
            if self.indexes[lower].has_entry(victim) or (
                    lower is TierName.DISK and self.on_disk_elsewhere is not None
                    and self.on_disk_elsewhere(victim)):
                return True
            free, below = self.indexes[lower].peek(keep, victim)
            if free:
                return True
            if below is not None:
                return self._room_below(below, lower, keep)
        return False

    def _plan_demotion(self, victim: ChunkKey, src: Location, spare: Collection[ChunkKey] = (),
                       keep: Collection[ChunkKey] = ()) -> tuple[Move, ...]:
        """Moves that keep ``victim`` (evicted from ``src``) one tier down, or further down
        when a tier has no room now (every slot pinned or being written: host slots held
        by their chunks' background writes); none when a lower tier holds it already."""
        for lower in self.order[self.order.index(src.tier) + 1:]:
            if self.indexes[lower].has_entry(victim):
                self.indexes[lower].touch(victim)
                return ()
            if lower is TierName.DISK and self.on_disk_elsewhere is not None \
                    and self.on_disk_elsewhere(victim):
                return ()
            plan = self.plan_store(victim, lower, spare, keep)
            if plan is not None:
                self.demotions += 1
                return (*plan.demotions, Move(victim, src, plan.dst))
        self.drops += 1
        return ()

    def finish(self, key: ChunkKey, dst: Location, ok: bool) -> bool:
        """End a reservation: visible (True) when ``ok`` and its slot is still in service."""
        index = self.indexes[dst.tier]
        if ok:
            return index.commit(key)
        index.abort(key)
        return False

    def discard(self, key: ChunkKey) -> int:
        """Drop ``key`` from every tier (for example after a failed checksum); ``on_discard``
        is told."""
        if self.on_discard is not None:
            self.on_discard(key)
        return sum(index.discard(key) for index in self.indexes.values())
