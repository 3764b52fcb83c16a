"""Telling a router again what kvtier's tiers hold, after it forgot it all.

vLLM's plain cache reset (``reset_prefix_cache`` without the connector's) clears its GPU
cache and publishes ``AllBlocksCleared``. That event names no medium, so a router takes it
as every tier of the engine cleared, while kvtier's tiers still hold their chunks and load
them. Each chunk the router had been told of is told again: a chunk after its parent (a
router drops a stored event whose parent block it does not know), a bounded share a take,
so that a disk of a million chunks costs each step little.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from kvtier.connector.scheduler.event_backlog import Slot
from kvtier.keys import ChunkKey

Parent = Callable[[ChunkKey], "ChunkKey | None"]  # a recorded chunk's parent chunk, if recorded


class Retell:
    """The slots (a chunk in one medium) to be told again, a chunk after its parent.

    Contract: ``add(slots, parent)`` adds ``slots`` to those waiting and orders them all by
    how many recorded ancestors each chunk has (``parent``: a chunk's parent, None at a
    prompt's first chunk or where not recorded). ``next(count)`` takes the first ``count``
    at most; ``pop(key)`` takes every slot of chunk ``key`` (its child is told now, so it
    goes first); ``drop(slot)`` forgets one (removed from its tier, or stored anew, before
    it was told again): True if it was waiting. Nothing here blocks or does I/O."""

    def __init__(self) -> None:
        self._order: deque[Slot] = deque()  # in the order to be told; some taken already
        self._slots: set[Slot] = set()  # those still waiting
        self._by_key: dict[ChunkKey, list[Slot]] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._by_key

    def add(self, slots: Iterable[Slot], parent: Parent) -> None:
        every = list(self._slots | set(slots))
        depth = depths({slot[0] for slot in every}, parent)
        every.sort(key=lambda slot: depth[slot[0]])
        self._order, self._slots, self._by_key = deque(every), set(every), {}
        for slot in every:
            self._by_key.setdefault(slot[0], []).append(slot)

    def next(self, count: int) -> list[Slot]:
        taken: list[Slot] = []
        while self._order and len(taken) < count:
            slot = self._order.popleft()
            if self.drop(slot):
                taken.append(slot)
        return taken

    def pop(self, key: ChunkKey) -> list[Slot]:
        slots = self._by_key.pop(key, [])
        self._slots.difference_update(slots)
        return slots

    def drop(self, slot: Slot) -> bool:
        if slot not in self._slots:
            return False
        self._slots.discard(slot)
        left = self._by_key[slot[0]]
        left.remove(slot)
        if not left:
            del self._by_key[slot[0]]
        return True


def depths(keys: set[ChunkKey], parent: Parent) -> dict[ChunkKey, int]:
    """How many ancestors each of ``keys`` has, following ``parent`` (each chunk visited once;
    a chain that comes back on itself, which hashes make unlikely, ends there)."""
    known: dict[ChunkKey, int] = {}
    for key in keys:
        chain: list[ChunkKey] = []
        seen: set[ChunkKey] = set()
        at: ChunkKey | None = key
        while at is not None and at not in known and at not in seen:
            chain.append(at)
            seen.add(at)
            at = parent(at)
        depth = known.get(at, -1) if at is not None else -1
        for link in reversed(chain):
            depth += 1
            known[link] = depth
    return {key: known[key] for key in keys}
