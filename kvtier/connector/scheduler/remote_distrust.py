"""Remote chunks whose read failed lately, for every request of the engine.

The store answers a lookup (EXISTS) for a damaged value as it does for a good one, so a
chunk whose read just failed its checks would be offered to each new request, each paying
a failed load. Distrusting it for a while stops that; forgetting it later lets a value
rewritten since (by this engine, once it recomputed the chunk, or by another) hit again.
A read that failed on its way (a timeout, the workers' store out of service) says nothing
of the value: that chunk is distrusted only until the workers try the store again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvtier.keys import ChunkKey

DISTRUST_S = 60.0  # how long a chunk whose remote read failed is not looked for there
DISTRUST_MAX = 4096  # chunks distrusted at once, at most: the oldest is forgotten first


class DistrustedKeys:
    """Contract: ``add(keys, ttl_s)`` distrusts ``keys`` for ``ttl_s`` seconds from now
    (the default given at construction when None; one added again starts over, unless it
    was distrusted for longer); ``key in`` says whether a key is distrusted now. At most
    ``capacity`` keys are kept, the oldest forgotten first (forgetting one costs at most one
    more failed load). Not thread-safe: the scheduler side's thread only."""

    def __init__(self, ttl_s: float = DISTRUST_S, capacity: int = DISTRUST_MAX,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s, self._capacity, self._clock = ttl_s, max(1, capacity), clock
        self._until: OrderedDict[ChunkKey, float] = OrderedDict()  # key -> distrusted until

    def add(self, keys: Iterable[ChunkKey], ttl_s: float | None = None) -> None:
        until = self._clock() + (self._ttl_s if ttl_s is None else ttl_s)
        for key in keys:  # (a shorter time never cuts a longer one short)
            self._until[key] = max(until, self._until.pop(key, until))
        while len(self._until) > self._capacity:
            self._until.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes):
            return False
        until = self._until.get(ChunkKey(key))
        if until is None:
            return False
        if self._clock() < until:
            return True
        del self._until[ChunkKey(key)]  # past its time: forgotten
        return False

    def __len__(self) -> int:
        return len(self._until)
