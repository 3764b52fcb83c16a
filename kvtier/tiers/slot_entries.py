"""The values ``SlotIndex`` keeps and hands out: an entry's state, a reservation, a census."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvtier.keys import ChunkKey


class EntryState(Enum):
    WRITING = "writing"  # reserved; bytes being written; invisible
    READY = "ready"  # visible to lookups
    DOOMED = "doomed"  # discarded while pinned; freed at the last unpin


@dataclass
class SlotEntry:
    slot: int
    state: EntryState
    pins: int = 0


@dataclass(frozen=True)
class Reservation:
    """A slot held for ``key`` until ``commit`` or ``abort``.

    ``victim`` is the key evicted to make room, if any: it is gone from the index, but its
    bytes stay in ``slot`` until the holder overwrites them, so the holder may first copy the
    victim down to a lower tier.
    """

    key: ChunkKey
    slot: int
    victim: ChunkKey | None = None


@dataclass(frozen=True)
class IndexCensus:
    """A count of one index's entries by state, and the pins they hold."""

    entries: int
    ready: int
    writing: int
    doomed: int
    pins: int
