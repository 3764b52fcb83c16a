"""A disk path back in service after being out since the start: the chunks found on it
adopted into the disk index and its other slots put back in service, a share at a time.

A path may hold hundreds of thousands of slots and chunks. Taking them all back at once
would hold a scheduler step, or every get and put of a store, for a second or more, so each
``step`` does a bounded share of the work: first the chunks found are adopted, the newest
first, then the path's other slots are put back in service a slice at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice

from kvtier.keys import ChunkKey
from kvtier.tiers.index import SlotIndex

SLOTS_PER_CHUNK = 8  # a step's budget counts a chunk adopted as this many slots put back

Adopted = list[tuple[ChunkKey, int]]  # (key, slot)


@dataclass
class _Return:
    """One path's work left: the chunks found not adopted yet (newest first), then its
    slots not put back yet (from ``done`` on)."""

    slots: range
    found: Iterator[tuple[ChunkKey, int]] | None
    done: int = 0


class PathAdoption:
    """The disk paths back in service, each with the chunks found on it waiting.

    Contract (every call under the lock of ``index``'s owner): ``start(path, slots,
    found)`` takes a path back: ``slots`` (the path's, retired while it was out) and
    ``found`` (the (key, slot) of each chunk on it, newest first: read a share at a time,
    so it may be lazy); nothing changes in the index yet. ``step(budget)`` does a share of
    the work and returns the chunks adopted: at most ``budget`` chunks are adopted, each to
    be evicted before every chunk held, oldest first (each adopted goes to the front),
    unless the index holds its key (a copy stored elsewhere meanwhile), or it was discarded
    meanwhile (``discarded``: a failed check of another copy), whose slot comes back empty;
    once every chunk found is, the path's other slots are put back in service,
    ``SLOTS_PER_CHUNK`` for each chunk of ``budget`` (one still held, pinned or being
    written, is freed when its holder lets go). Until then a slot stays out of service.
    ``path_out(path)``: the path went out of service again; its work left is dropped (the
    owner retires its slots again). ``waiting``: whether work is left.
    """

    def __init__(self, index: SlotIndex) -> None:
        self._index = index
        self._returns: dict[int, _Return] = {}
        self._discards: set[ChunkKey] = set()  # discarded while some wait

    @property
    def waiting(self) -> bool:
        return bool(self._returns)

    def start(self, path: int, slots: range, found: Iterable[tuple[ChunkKey, int]]) -> None:
        if not self._returns:  # discards told before are of no chunk waiting now
            self._discards.clear()
        self._returns[path] = _Return(slots, iter(found))

    def step(self, budget: int) -> Adopted:
        adopted: Adopted = []
        for path, back in list(self._returns.items()):
            if back.found is not None and budget > 0:
                taken = self._adopt(islice(back.found, budget), back.slots, adopted)
                back.found = back.found if taken == budget else None
                budget -= taken
            if back.found is None and budget > 0:
                end = back.done + budget * SLOTS_PER_CHUNK
                self._index.unretire(back.slots[back.done:end])
                budget -= -(-(min(end, len(back.slots)) - back.done) // SLOTS_PER_CHUNK)
                back.done = end
                if end >= len(back.slots):
                    del self._returns[path]
        return adopted

    def path_out(self, path: int) -> None:
        self._returns.pop(path, None)

    def discarded(self, key: ChunkKey) -> None:
        if self._returns:
            self._discards.add(key)

    def _adopt(self, found: Iterable[tuple[ChunkKey, int]], slots: range,
               adopted: Adopted) -> int:
        taken = 0
        for key, slot in found:
            taken += 1
            if slot in slots and self._index.adopt_retired(key, slot, first=True):
                if key in self._discards:
                    self._index.discard(key)  # its slot back in service, empty
                else:
                    adopted.append((key, slot))
        return taken
