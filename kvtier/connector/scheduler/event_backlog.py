"""The KV events not yet handed to vLLM, kept as each chunk's net change per medium.

vLLM takes a connector's events once a step, and only after a step it ran: between two takes
a tier may gain and lose a chunk, or lose far more chunks at once than one take should carry
(a disk path of millions of chunks taken out of service). A router that missed a removal
credits the engine with the chunk for good, so a removal of a chunk the router was told of
is never dropped; a stored event and a removal of the same chunk and medium before either
was handed over cancel out (the router was told nothing, and nothing holds it). Each take
hands over at most a given number of changes, oldest first; the rest wait for the next.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from heapq import merge
from itertools import islice
from operator import itemgetter
from typing import Any

from kvtier.keys import ChunkKey

Slot = tuple[ChunkKey, str, bool]  # a chunk, the medium, and whether in the remote store


class EventBacklog:
    """Contract: ``change(stored, slot, blocks)`` notes that ``slot`` (a chunk in one
    medium) was stored or removed (``blocks``: what its event names). A change that undoes
    one still waiting cancels it (nothing is handed over); a change already waiting is kept
    once, in its first place. ``take(count)`` hands over the oldest ``count`` changes at
    most, as ``(stored, slot, blocks)``, and keeps the rest in order. At most ``limit``
    stored changes wait: past it the oldest of them is dropped (the router is told nothing
    of it, and of its removal only what it ignores), counted in
    ``counters["kv_events_dropped"]``. Removals are never dropped: at most one waits per
    chunk and medium, and only of a chunk recorded while a tier held it, so that they take
    no more room than the records of the chunks the tiers held."""

    def __init__(self, limit: int, counters: Counter) -> None:
        self._limit, self._counters = limit, counters
        self._stored: OrderedDict[Slot, tuple[int, Any]] = OrderedDict()  # as they came
        self._removed: OrderedDict[Slot, tuple[int, Any]] = OrderedDict()
        self._next = 0  # the order of a change among both

    def __len__(self) -> int:
        return len(self._stored) + len(self._removed)

    def change(self, stored: bool, slot: Slot, blocks: Any) -> None:
        same, other = (self._stored, self._removed) if stored else (self._removed, self._stored)
        if other.pop(slot, None) is not None or slot in same:
            return  # undoes a change still waiting, or repeats one
        same[slot] = (self._next, blocks)
        self._next += 1
        if stored and len(same) > self._limit:
            same.popitem(last=False)
            self._counters["kv_events_dropped"] += 1

    def take(self, count: int) -> list[tuple[bool, Slot, Any]]:
        stored = ((order, True, slot, blocks) for slot, (order, blocks) in self._stored.items())
        removed = ((order, False, slot, blocks) for slot, (order, blocks) in self._removed.items())
        taken = [(kind, slot, blocks) for _, kind, slot, blocks
                 in islice(merge(stored, removed, key=itemgetter(0)), count)]
        for kind, slot, _ in taken:
            del (self._stored if kind else self._removed)[slot]
        return taken
