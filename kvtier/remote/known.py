"""Chunks known to be in the remote store (written there, or read from it), so that they are
not written again: a bounded set, oldest forgotten first (forgetting one costs one write)."""

from __future__ import annotations

from collections import OrderedDict

from kvtier.keys import ChunkKey

KNOWN_MIN = 4096  # chunks remembered, at least


class KnownKeys:
    """A bounded set of keys, oldest forgotten first (forgetting one only costs a put)."""

    def __init__(self, capacity: int) -> None:
        self._keys: OrderedDict[ChunkKey, None] = OrderedDict()
        self._capacity = max(1, capacity)

    def add(self, key: ChunkKey) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)

    def discard(self, key: ChunkKey) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys
