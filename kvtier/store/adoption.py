"""The chunks of a disk path back after being out since the start, adopted a share at a time.

A path back may hold hundreds of thousands of chunks. Adopting them all under the store's
lock would hold every get and put for a second or more, so each lock hold adopts at most
``ADOPT_PER_HOLD``, the newest first, and the slots not adopted yet stay out of service.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from kvtier.disk.recovery import RecoveredSlot
from kvtier.keys import ChunkKey
from kvtier.tiers.index import SlotIndex

ADOPT_PER_HOLD = 4096  # chunks adopted per hold of the store's lock, at most


class Adoption:
    """The chunks of each path back waiting to be adopted into the disk index.

    Contract (every call with the store's lock held): ``start(path, slots, found)`` puts
    ``slots`` (the path's) back in service but those ``found`` (newest first: sorted off
    the lock) holds, which stay retired and wait; True when some wait. ``step(budget)``
    adopts at most ``budget`` of them (``ADOPT_PER_HOLD`` unless given), to be evicted
    before every chunk held, oldest first (each adopted goes to the front), each unless the
    index holds its key (a copy stored elsewhere meanwhile) or it was discarded meanwhile
    (``discarded``: a failed check of another copy), whose slot comes back empty; returns
    how many were adopted. ``path_out(path)``: the path went out of service again, its
    chunks waiting are dropped (their slots go out with it). ``waiting``: whether some wait.
    """

    def __init__(self, index: SlotIndex) -> None:
        self._index = index
        self._waiting: dict[int, deque[tuple[ChunkKey, int]]] = {}  # path -> newest first
        self._discards: set[ChunkKey] = set()  # discarded while some wait

    @property
    def waiting(self) -> bool:
        return bool(self._waiting)

    def start(self, path: int, slots: range, found: Sequence[RecoveredSlot]) -> bool:
        kept = self._index.unretire(slots, but={r.slot for r in found})
        if not kept:
            return False
        if not self._waiting:  # discards told before are of no chunk waiting now
            self._discards.clear()
        self._waiting[path] = deque((r.header.key, r.slot) for r in found if r.slot in kept)
        return True

    def step(self, budget: int | None = None) -> int:
        budget, adopted = ADOPT_PER_HOLD if budget is None else budget, 0
        for path, waiting in list(self._waiting.items()):
            taken = min(budget, len(waiting))
            for _ in range(taken):
                key, slot = waiting.popleft()
                if self._index.adopt_retired(key, slot, first=True):
                    if key in self._discards:
                        self._index.discard(key)  # its slot back in service, empty
                    else:
                        adopted += 1
            budget -= taken
            if not waiting:
                del self._waiting[path]
            if budget <= 0:
                break
        return adopted

    def path_out(self, path: int) -> None:
        self._waiting.pop(path, None)

    def discarded(self, key: ChunkKey) -> None:
        if self._waiting:
            self._discards.add(key)


def adopt(index: SlotIndex, found: Iterable[RecoveredSlot]) -> int:
    """Put the chunks ``found`` on disk in ``index``, to be evicted before every chunk held
    and oldest first, each whose key and slot are free there; how many were (at open)."""
    return sum(index.adopt(slot.header.key, slot.slot, first=True)
               for slot in sorted(found, key=lambda r: r.header.generation, reverse=True))
