"""The KV events not yet handed to vLLM, kept as each chunk's net change per medium.

vLLM takes a connector's events once a step, and only after a step it ran: between two takes
a tier may gain and lose a chunk, or lose far more chunks at once than one take should carry
(a disk path of millions of chunks taken out of service). A router that missed a removal
credits the engine with the chunk for good, so a removal of a chunk the router was told of
is never dropped; a stored event and a removal of the same chunk and medium before either
was handed over cancel out (the router was told nothing, and nothing holds it). Each take
hands over at most a given number of changes, oldest first; the rest wait for the next.

A router drops a chunk's stored event whose parent block it was not told of, so a chunk
stored again after its stored change was cancelled takes that change's place back, not a
new one after the chunks stored since (its children among them): the place of a cancelled
change is kept, a take passing it goes on, and a chunk stored again is handed from there,
unless its parent's stored change waits after that place (its parent was stored again with
a new place, say, after a take handed its removal): then the chunk takes a new place too.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from heapq import heapify, heappop, heappush
from typing import Any

from kvtier.keys import ChunkKey

Slot = tuple[ChunkKey, str, bool]  # a chunk, the medium, and whether in the remote store


class EventBacklog:
    """Contract: ``change(stored, slot, blocks, after)`` notes that ``slot`` (a chunk in one
    medium) was stored or removed (``blocks``: what its event names). A change that undoes
    one still waiting cancels it (nothing is handed over); a change already waiting is kept
    once, in its first place; a stored change cancelled and made again takes its first
    place back if that is after place ``after`` (its parent's stored change waiting there),
    else a new one (at most ``limit`` such places are kept, the oldest forgotten past it).
    ``place(slot)`` is the place of the stored change of ``slot`` waiting (None: none);
    ``held(slot)`` whether the router holds ``slot`` once the changes waiting are handed
    over (a stored change waits, or one was handed and no removal since, handed or waiting:
    a slot told of is remembered until its removal is handed over). ``cleared()``: the
    router forgot every slot; those it holds once told anew are returned, and nothing waits.
    ``take(count)`` hands over the oldest ``count`` changes at most, as ``(stored, slot,
    blocks)``, and keeps the rest in order. At most ``limit`` stored changes wait: past it
    the oldest of them is dropped (the router is told nothing of it), counted in
    ``counters["kv_events_dropped"]``, and so is the removal that follows it (the router
    never learnt the chunk: a store after it is told, not cancelled; the last ``limit``
    slots dropped are kept for this). A removal of a chunk the router was told of is never
    dropped: at most one waits per chunk and medium, and only of a chunk recorded while a
    tier held it, so that they take no more room than the records of the chunks the tiers
    held."""

    def __init__(self, limit: int, counters: Counter,
                 removals: Iterable[tuple[Slot, Any]] = ()) -> None:
        """``removals``: (slot, blocks) of each removal to be handed over first."""
        self._limit, self._counters = limit, counters
        self._stored: dict[Slot, tuple[int, Any]] = {}  # the stored changes: (place, blocks)
        self._places: list[tuple[int, Slot]] = []  # a heap of their places, and of others
        self._cancelled: OrderedDict[Slot, tuple[int, bool]] = OrderedDict()  # place, in heap
        self._stale = 0  # places in the heap of cancelled changes no longer kept
        self._removed: OrderedDict[Slot, tuple[int, Any]] = OrderedDict()  # as they came
        self._dropped: OrderedDict[Slot, None] = OrderedDict()  # stored changes dropped
        self._told: set[Slot] = set()  # slots handed over as stored, not removed since
        self._next = 0  # the order of a change among both
        for slot, blocks in removals:
            self.change(False, slot, blocks)

    def __len__(self) -> int:
        return len(self._stored) + len(self._removed)

    def place(self, slot: Slot) -> int | None:
        held = self._stored.get(slot)
        return None if held is None else held[0]

    def held(self, slot: Slot) -> bool:
        return slot in self._stored or (slot in self._told and slot not in self._removed)

    def change(self, stored: bool, slot: Slot, blocks: Any, after: int = -1) -> None:
        if stored:
            self._store(slot, blocks, after)
            return
        if slot in self._dropped:  # the router was never told of it: nothing to undo
            del self._dropped[slot]
            return
        held = self._stored.pop(slot, None)
        if held is not None:
            self._cancel(slot, held[0])
        elif slot not in self._removed and slot not in self._cancelled:
            self._removed[slot] = (self._next, blocks)
            self._next += 1

    def told(self, blocks: dict[ChunkKey, Any]) -> list[tuple[Slot, Any]]:
        """The slots the router holds now (told of, and no removal handed over since), each
        with what its event names: its removal's waiting (its record may be let go), else
        its chunk's in ``blocks``."""
        told = []
        for slot in self._told:
            waiting = self._removed.get(slot)
            named = waiting[1] if waiting is not None else blocks.get(slot[0])
            if named is not None:
                told.append((slot, named))
        return told

    def cleared(self) -> set[Slot]:
        """The router forgot every slot (vLLM's ``AllBlocksCleared``, handed over before the
        changes waiting now): returns the slots it was told of and that are still held, those
        whose stored change waits and those dropped, all to be told anew; nothing waits any
        more (the removals: it holds none of those now)."""
        held = self._told  # taken over, not copied: a disk may hold a million of them
        held.difference_update(self._removed)
        held.update(self._stored, self._dropped)
        self._stored, self._places, self._stale, self._told = {}, [], 0, set()
        self._cancelled, self._removed, self._dropped = OrderedDict(), OrderedDict(), OrderedDict()
        return held

    def take(self, count: int) -> list[tuple[bool, Slot, Any]]:
        taken: list[tuple[bool, Slot, Any]] = []
        while len(taken) < count:
            head = self._head()
            removal = next(iter(self._removed.items()), None)
            if removal is not None and (head is None or removal[1][0] < head[0]):
                self._removed.popitem(last=False)
                self._told.discard(removal[0])
                taken.append((False, removal[0], removal[1][1]))
            elif head is not None:
                heappop(self._places)
                self._told.add(head[1])
                taken.append((True, head[1], self._stored.pop(head[1])[1]))
            else:
                break
        return taken

    def _store(self, slot: Slot, blocks: Any, after: int) -> None:
        self._dropped.pop(slot, None)
        if self._removed.pop(slot, None) is not None or slot in self._stored:
            return  # undoes a removal still waiting, or repeats a change
        kept = self._cancelled.pop(slot, None)
        if kept is not None and kept[0] <= after:  # before its parent's: a new place
            self._stale += kept[1]  # its place in the heap, if there, no longer kept
            kept = None
        if kept is None:
            place, placed = self._next, False
            self._next += 1
        else:
            place, placed = kept
        if not placed:
            heappush(self._places, (place, slot))
        self._stored[slot] = (place, blocks)
        if len(self._stored) > self._limit:
            self._drop()

    def _drop(self) -> None:
        """The oldest stored change dropped: its chunk's removal, which the router would
        ignore, is dropped too, so that a store after it is told (``limit`` kept)."""
        self._head()
        slot = heappop(self._places)[1]
        del self._stored[slot]
        self._counters["kv_events_dropped"] += 1
        self._dropped[slot] = None
        if len(self._dropped) > self._limit:
            self._dropped.popitem(last=False)

    def _cancel(self, slot: Slot, place: int) -> None:
        """A stored change undone by a removal: its place is kept for the chunk's next."""
        if len(self._cancelled) >= self._limit:
            self._stale += self._cancelled.popitem(last=False)[1][1]
        self._cancelled[slot] = (place, True)
        if self._stale > self._limit:  # rebuilt without them: the heap stays bounded
            self._places = [(place, slot) for slot, (place, _) in self._stored.items()]
            self._places += [(place, slot) for slot, (place, placed) in self._cancelled.items()
                             if placed]
            heapify(self._places)
            self._stale = 0

    def _head(self) -> tuple[int, Slot] | None:
        """The place of the oldest stored change, passing the places before it that no
        longer name one (a cancelled change's place stays kept, out of the heap)."""
        places = self._places
        while places:
            place, slot = places[0]
            held = self._stored.get(slot)
            if held is not None and held[0] == place:
                return place, slot
            heappop(places)
            if self._cancelled.get(slot) == (place, True):
                self._cancelled[slot] = (place, False)
            else:
                self._stale -= 1
        return None
