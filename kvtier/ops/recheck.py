"""Reading again the slots of a segment in use that looked bad to ``kvtier verify``.

A segment in use is being written while it is read: a write puts a slot down before its index
entry, and a removal blanks the entry before the slot's header, so a slot read while one is
under way looks bad (a good chunk the index does not name yet, an entry naming a slot just
blanked, a header over the payload of the chunk before it). After a pause (``settle``), ample
for what was under way to end, the slots are read again and the index afresh; a slot is
still bad the same way only when both reads found the same bytes and the same index entry.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time

from kvtier.io.safefs import SafeDir, read_at
from kvtier.ops.cache import Segment, slot_file_sizes
from kvtier.ops.index_cursor import IndexCursor, Named
from kvtier.ops.segments import index_entries
from kvtier.ops.slot_reads import Look, look, open_slot_file

RECHECK_PAUSE_S = 0.5  # a write or a removal under way takes milliseconds to end


def settle() -> None:
    """The pause before the slots that looked bad are read again."""
    time.sleep(RECHECK_PAUSE_S)


def seen_of(seen: Look, named: Named) -> tuple:
    """What one read found of a slot: its ``look``, whether the index names it, and the
    entry it holds there (``index_entries``: None when bad or past the end of the files)."""
    return seen, *named


def read_again(segment: Segment, directory: SafeDir, names: dict[int, str],
               slots: list[int]) -> dict[int, tuple]:
    """After ``settle``: ``seen_of`` of each of ``slots`` (sorted), the index read afresh
    (walked, not held: ``IndexCursor``) and the slots from the files of ``names`` (the
    listing the first read used); a slot past the end of its file is free."""
    settle()
    meta = segment.meta
    stride, per_file = meta.stride, meta.file_slots
    sizes = slot_file_sizes(meta, directory, names)
    found = {}
    with contextlib.closing(index_entries(segment, directory, sizes)) as entries:
        index = IndexCursor(entries)
        for number, group in itertools.groupby(slots, key=lambda slot: slot // per_file):
            fd = open_slot_file(directory, names[number], os.O_RDONLY) if number in sizes else -1
            try:
                for slot in group:
                    at = slot % per_file * stride
                    data = read_at(fd, stride, at) if at + stride <= sizes.get(number, 0) else b""
                    found[slot] = seen_of(look(data, segment.digest, meta.raw_bytes), index.at(slot))
            finally:
                if fd >= 0:
                    os.close(fd)
    return found
