"""Each disk write's stamp, its generation and time, given when its slot is reserved.

A slot's header carries a generation (its writer's count: a later write has a larger one)
and the time it was written. ``kvtier gc`` reads a prompt's order from them (its head was
written before its tail: ``kvtier.ops.victims``), and a restart keeps the later of two
copies of a key. Both are taken when the store reserves the disk slot, under its lock, in
the order it plans chunks (a prompt's head before its tail), not when an I/O thread gets
to the write: writes run on several threads and paths at once and finish in any order."""

from __future__ import annotations

import itertools
import threading
import time

Stamp = tuple[int, int]  # (generation, created_ns)


class WriteStamps:
    """Stamps of one disk tier's writes.

    Contract: ``reserve(slot)`` stamps the next write of ``slot`` now; ``of(slot)`` is that
    stamp, or a new one kept for it when the slot was not reserved; ``written(slot)``, once
    the write succeeded, lets it go: a write tried again after a failure keeps its place.
    Generations only grow: ``restart(last)`` carries on past ``last`` (what a restart found
    on disk) and forgets the stamps given before; ``past(last)`` carries on past ``last``
    and keeps them. ``reserve`` and ``take`` may run on different threads (a dict's set
    and pop are atomic; the count is taken under a lock)."""

    def __init__(self) -> None:
        self._next = itertools.count(time.time_ns())
        self._given: dict[int, Stamp] = {}
        self._lock = threading.Lock()

    def reserve(self, slot: int) -> None:
        self._given[slot] = self._stamp()

    def of(self, slot: int) -> Stamp:
        stamp = self._given.get(slot)
        if stamp is None:
            stamp = self._given[slot] = self._stamp()
        return stamp

    def _stamp(self) -> Stamp:
        with self._lock:  # not between ``past``'s look at the count and its replacement
            return next(self._next), time.time_ns()

    def written(self, slot: int) -> None:
        self._given.pop(slot, None)

    def restart(self, last_generation: int) -> None:
        with self._lock:
            self._next = itertools.count(max(last_generation + 1, time.time_ns()))
        self._given.clear()

    def past(self, generation: int) -> None:
        """Every later stamp's generation is past ``generation`` (a path's chunks recovered
        while the tier runs), the stamps given kept."""
        with self._lock:
            self._next = itertools.count(max(generation + 1, next(self._next)))
