"""Where other writers hold each chunk, as a reader knows it: every copy of a chunk by its
key, compact (one small integer a copy) and with every change O(1), however many copies of
one chunk a log names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvtier.keys import ChunkKey
from kvtier.segment.index_file import MAX_SLOTS

_SLOT_BITS = MAX_SLOTS.bit_length() - 1  # a local slot is below MAX_SLOTS
_SIZE_BITS = 40  # codec (8 bits) and payload length (32 bits) below the place
_PAYLOAD_MASK = (1 << 32) - 1


@dataclass(frozen=True)
class Copy:
    """One copy of a chunk: local ``slot`` of the segment numbered ``source`` (the reader
    numbers the segments it follows), and what its log says of the slot's payload."""

    source: int
    slot: int
    codec: int
    payload_bytes: int


def _place(source: int, slot: int) -> int:
    return source << _SLOT_BITS | slot


def _pack(copy: Copy) -> int:
    return (_place(copy.source, copy.slot) << _SIZE_BITS | copy.codec << 32
            | copy.payload_bytes)


def unpack(packed: int) -> Copy:
    place = packed >> _SIZE_BITS
    return Copy(place >> _SLOT_BITS, place & (MAX_SLOTS - 1), packed >> 32 & 0xFF,
                packed & _PAYLOAD_MASK)


class _Copies:
    """Two or more copies of one chunk: a list, and where each place sits in it (a removal
    moves the last copy into the hole)."""

    __slots__ = ("at", "packed")

    def __init__(self, packed: list[int]) -> None:
        self.packed = packed
        self.at = {p >> _SIZE_BITS: n for n, p in enumerate(packed)}

    def put(self, packed: int) -> None:
        n = self.at.get(packed >> _SIZE_BITS)
        if n is None:
            self.at[packed >> _SIZE_BITS] = len(self.packed)
            self.packed.append(packed)
        else:
            self.packed[n] = packed

    def remove(self, place: int) -> None:
        n = self.at.pop(place, None)
        if n is None:
            return
        last = self.packed.pop()
        if n < len(self.packed):
            self.packed[n] = last
            self.at[last >> _SIZE_BITS] = n


class ChunkIndex:
    """Every copy of each chunk the reader knows of, by key.

    Contract: ``put(key, copy)`` records a copy (replacing what was known of that segment's
    slot for ``key``), True when ``key`` had none; ``remove(key, source, slot)`` forgets it
    (nothing when unknown), True when that was ``key``'s last copy; ``items()`` lists one
    copy of each key; ``listener``, when set, is called with (key, copy) when a key gains
    its first copy and (key, None) when it loses its last; ``first(key)`` is one copy of
    ``key`` (None when none is known), ``copies(key)`` every one, lazily (O(1) a copy);
    ``at(key, source, slot)`` is that copy, if known; ``len()`` counts the distinct keys.
    Each is O(1), whatever the number of copies of one key. A key with one copy costs one
    dict entry and one integer. Not thread-safe: the caller holds its lock."""

    def __init__(self) -> None:
        self._by_key: dict[ChunkKey, int | _Copies] = {}
        self.listener: Callable[[ChunkKey, Copy | None], None] | None = None

    def put(self, key: ChunkKey, copy: Copy) -> bool:
        assert 0 <= copy.slot < MAX_SLOTS and 0 <= copy.codec <= 0xFF \
            and 0 <= copy.payload_bytes <= _PAYLOAD_MASK, copy
        packed = _pack(copy)
        held = self._by_key.get(key)
        if held is None or (isinstance(held, int) and held >> _SIZE_BITS == packed >> _SIZE_BITS):
            self._by_key[key] = packed
        elif isinstance(held, int):
            self._by_key[key] = _Copies([held, packed])
        else:
            held.put(packed)
        if held is None and self.listener is not None:
            self.listener(key, copy)
        return held is None

    def remove(self, key: ChunkKey, source: int, slot: int) -> bool:
        held = self._by_key.get(key)
        place = _place(source, slot)
        if isinstance(held, int):
            if held >> _SIZE_BITS == place:
                del self._by_key[key]
                if self.listener is not None:
                    self.listener(key, None)
                return True
        elif held is not None:
            held.remove(place)
            if len(held.packed) == 1:
                self._by_key[key] = held.packed[0]
        return False

    def items(self) -> list[tuple[ChunkKey, Copy]]:
        return [(key, unpack(packed)) for key, packed in self.packed_items()]

    def packed_items(self) -> list[tuple[ChunkKey, int]]:
        """``items``, each copy packed (``unpack`` it): quick to take under a lock."""
        return [(key, held if isinstance(held, int) else held.packed[0])
                for key, held in self._by_key.items()]

    def first(self, key: ChunkKey) -> Copy | None:
        held = self._by_key.get(key)
        if held is None:
            return None
        return unpack(held if isinstance(held, int) else held.packed[0])

    def copies(self, key: ChunkKey) -> Iterator[Copy]:
        """Every copy of ``key`` known, ``first``'s first, unpacked as they are taken (O(1)
        each: take no more than needed; change nothing of ``key`` before the last is)."""
        held = self._by_key.get(key)
        if held is not None:
            yield from (unpack(p) for p in ((held,) if isinstance(held, int) else held.packed))

    def at(self, key: ChunkKey, source: int, slot: int) -> Copy | None:
        held = self._by_key.get(key)
        place = _place(source, slot)
        if isinstance(held, int):
            return unpack(held) if held >> _SIZE_BITS == place else None
        if held is None or place not in held.at:
            return None
        return unpack(held.packed[held.at[place]])

    def __len__(self) -> int:
        return len(self._by_key)
