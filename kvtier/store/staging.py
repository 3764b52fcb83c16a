"""Chunks a ``get`` is reading into host memory, for other gets of the same chunk to wait for.

While one ``get`` stages a disk chunk into a host slot, that slot is reserved (invisible)
and a second reservation of the same key is refused: without this, a second ``get`` of the
same prefix took the refusal for "no room" and missed a chunk that ``lookup`` reports.
"""

from __future__ import annotations

import threading

from kvtier.keys import ChunkKey
from kvtier.store.books import Books
from kvtier.tiers.stack import StorePlan


class Stagings:
    """The host slots a ``get`` reserved for a chunk's read (from disk, another writer's
    segment or the remote store) and has not finished yet, by key.

    Contract: ``begin(plan)`` once such a slot is reserved, and ``end(plan)`` once that
    reservation is finished (committed or aborted): both with the store lock held (the
    ``Books`` given: it guards the stagings too). An
    ``end`` after the key's slot was reserved again by another ``begin`` ends nothing (the
    plan is the staging's identity), and that ``begin`` wakes whoever waited. ``busy(key)``
    (lock held) says whether a staging of ``key`` is in flight; ``wait(key, timeout)``
    (lock NOT held) returns once it ends: True, or False when it is still in flight after
    ``timeout`` seconds (None: no bound). A staged chunk costs a few dict operations; an
    ``Event`` is made only when someone waits.

    Whoever waits must hold no reservation that a staging could need to end: a ``get``
    waits only with its read window empty (``PrefixRead``).
    """

    def __init__(self, books: Books) -> None:
        self._books = books
        self._in_flight: dict[ChunkKey, StorePlan] = {}
        self._events: dict[ChunkKey, threading.Event] = {}  # keys someone waits for

    def begin(self, plan: StorePlan) -> None:
        self._wake(plan.key)  # a staging whose slot went back before its end: look again
        self._in_flight[plan.key] = plan

    def end(self, plan: StorePlan) -> None:
        if self._in_flight.get(plan.key) is plan:
            del self._in_flight[plan.key]
            self._wake(plan.key)

    def _wake(self, key: ChunkKey) -> None:
        event = self._events.pop(key, None)
        if event is not None:
            event.set()

    def busy(self, key: ChunkKey) -> bool:
        return key in self._in_flight

    def wait(self, key: ChunkKey, timeout: float | None) -> bool:
        with self._books.held():
            if key not in self._in_flight:
                return True
            event = self._events.get(key)
            if event is None:
                event = self._events[key] = threading.Event()
        return event.wait(timeout)

    def waited(self, key: ChunkKey) -> bool:
        """True when someone waits, or waited, for the staging of ``key`` in flight (lock
        held; for inspection)."""
        return key in self._events

    def __len__(self) -> int:
        """Stagings in flight (lock held; for checks of the bookkeeping)."""
        return len(self._in_flight)
