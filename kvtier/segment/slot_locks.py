"""Locks over a segment's slots, striped: a write into slots and the blanking of one that
checks first what the slot holds never interleave (the blank would land on the chunk just
written, which was reported written)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

STRIPES = 64


class SlotLocks:
    """``held(slot, count)``: slots ``slot`` to ``slot + count - 1`` (a segment's own
    numbering) held for the block; the stripes are taken in order, so two holders never
    wait for each other in a circle."""

    def __init__(self) -> None:
        self._locks = [threading.Lock() for _ in range(STRIPES)]

    @contextmanager
    def held(self, slot: int, count: int = 1) -> Iterator[None]:
        locks = [self._locks[s] for s in sorted({(slot + i) % STRIPES
                                                 for i in range(min(count, STRIPES))})]
        for lock in locks:
            lock.acquire()
        try:
            yield
        finally:
            for lock in reversed(locks):
                lock.release()
