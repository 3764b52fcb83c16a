"""What a store's disk holds, adopted into its disk index: at open (``adopt``), and from a
path back after being out since the start, ``ADOPT_PER_HOLD`` chunks a hold of the store's
lock (``kvtier.tiers.path_adoption.PathAdoption``: a path back may hold hundreds of
thousands, and adopting them all in one hold would hold every get and put for a second or
more)."""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.disk.recovery import RecoveredSlot
from kvtier.tiers.index import SlotIndex

ADOPT_PER_HOLD = 4096  # chunks adopted per hold of the store's lock, at most


def adopt(index: SlotIndex, found: Iterable[RecoveredSlot]) -> int:
    """Put the chunks ``found`` on disk in ``index``, to be evicted before every chunk held
    and oldest first, each whose key and slot are free there; how many were (at open)."""
    return sum(index.adopt(slot.header.key, slot.slot, first=True)
               for slot in sorted(found, key=lambda r: r.header.generation, reverse=True))
