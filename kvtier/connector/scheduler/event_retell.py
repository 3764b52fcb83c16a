"""Telling a router again what kvtier's tiers hold, after it forgot it all.

vLLM's plain cache reset (``reset_prefix_cache`` without the connector's) clears its GPU
cache and publishes ``AllBlocksCleared``. That event names no medium, so a router takes it
as every tier of the engine cleared, while kvtier's tiers still hold their chunks and load
them. Each chunk the router had been told of, or was to be told of, is told again after it,
a bounded share a take, so that a disk of a million chunks costs each step little. A router
drops a stored event whose parent block it does not know: ``KVEvents`` tells a chunk's
ancestors still waiting here before the chunk, so no order is kept here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.connector.scheduler.event_backlog import Slot
from kvtier.keys import ChunkKey

Parent = Callable[[ChunkKey], "ChunkKey | None"]  # a recorded chunk's parent, if recorded


class Retell:
    """The slots (a chunk in one medium) waiting to be told again.

    Contract: ``add(slots)`` adds ``slots`` to those waiting (each once); ``next(count)``
    returns the next ``count`` of them at most, in the order they came, still waiting: the
    caller drops each (``next`` never returns one again); ``drop(slot)`` takes one out
    (told now, or removed from its tier before it was told): True if it was waiting;
    ``slot in retell`` whether it waits; ``of(key)`` the slots of chunk ``key`` waiting,
    one per place (medium, remote) of ``places``; ``ancestors(key, parent)`` those of the
    ancestors of ``key`` (``parent``: a chunk's parent, None at a prompt's first chunk or
    where not recorded) that wait, up to the first that does not, the oldest first. Only
    ``add`` (once a clear) costs in proportion to all those waiting. Nothing here blocks or
    does I/O."""

    def __init__(self, places: Sequence[tuple[str, bool]]) -> None:
        self._places = places
        self._order: list[Slot] = []  # as they came; those before ``_at`` taken or passed
        self._at = 0
        self._slots: set[Slot] = set()  # those still waiting

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, slot: Slot) -> bool:
        return slot in self._slots

    def add(self, slots: set[Slot]) -> None:
        """(``slots`` is taken over when none waits: a disk may hold a million of them.)"""
        if not self._slots:
            self._slots, self._order = slots, list(slots)
        else:
            new = slots - self._slots
            self._order = [slot for slot in self._order[self._at:] if slot in self._slots]
            self._order += new
            self._slots |= new
        self._at = 0

    def next(self, count: int) -> list[Slot]:
        if not self._slots:
            self._order, self._at = [], 0
        taken: list[Slot] = []
        while self._at < len(self._order) and len(taken) < count:
            slot = self._order[self._at]
            self._at += 1
            if slot in self._slots:
                taken.append(slot)
        return taken

    def drop(self, slot: Slot) -> bool:
        if slot not in self._slots:
            return False
        self._slots.discard(slot)
        return True

    def of(self, key: ChunkKey) -> list[Slot]:
        return [slot for place in self._places if (slot := (key, *place)) in self._slots]

    def ancestors(self, key: ChunkKey, parent: Parent) -> list[Slot]:
        chain: list[list[Slot]] = []
        at, seen = parent(key), {key}
        while at is not None and at not in seen and (waiting := self.of(at)):
            chain.append(waiting)
            seen.add(at)  # a chain back on itself, which hashes make unlikely, ends there
            at = parent(at)
        return [slot for slots in reversed(chain) for slot in slots]
