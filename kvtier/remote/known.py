"""Chunks known to be in the remote store (written there, or read from it), so that they are
not written again, and loads counted towards ``remote_min_hits``: bounded, oldest forgotten
first (forgetting a key costs one more write, or a count started again)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvtier.keys import ChunkKey

KNOWN_MIN = 4096  # chunks remembered, at least


class KnownKeys:
    """A bounded set of keys, oldest forgotten first (forgetting one only costs a put)."""

    def __init__(self, capacity: int) -> None:
        self._keys: OrderedDict[ChunkKey, None] = OrderedDict()
        self._capacity = max(1, capacity)

    def add(self, key: ChunkKey) -> list[ChunkKey]:
        """Remember ``key`` (as the newest); the keys forgotten to make room."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        forgotten = []
        while len(self._keys) > self._capacity:
            forgotten.append(self._keys.popitem(last=False)[0])
        return forgotten

    def discard(self, key: ChunkKey) -> None:
        self._keys.pop(key, None)

    def oldest(self, count: int) -> list[ChunkKey]:
        """Up to ``count`` keys, oldest first, each made the newest (a round robin)."""
        taken = [key for key, _ in zip(self._keys, range(count), strict=False)]
        for key in taken:
            self._keys.move_to_end(key)
        return taken

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[ChunkKey]:
        return iter(list(self._keys))

    def clear(self) -> None:
        self._keys.clear()


class HitCounts:
    """Loads counted per key, bounded like ``KnownKeys``."""

    def __init__(self, capacity: int) -> None:
        self._counts: OrderedDict[ChunkKey, int] = OrderedDict()
        self._capacity = max(1, capacity)

    def hit(self, key: ChunkKey) -> int:
        """One more load of ``key``: its count now."""
        count = self._counts.pop(key, 0) + 1
        self._counts[key] = count
        while len(self._counts) > self._capacity:
            self._counts.popitem(last=False)
        return count

    def forget(self, key: ChunkKey) -> None:
        self._counts.pop(key, None)
