"""A segment's index read alongside its slot files, in rising slot order, without holding it.

A segment may hold millions of slots. ``kvtier verify`` reads each slot file in slot order and
needs, for each slot, the index entry that names it; ``IndexCursor`` walks the index entries
(``kvtier.ops.segments.index_entries``, themselves read a MiB at a time) in the same order, so
that what is held at once is the entry of the slot being looked at, not a dictionary of every
entry (hundreds of bytes each).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvtier.io.format import SlotHeader

Named = tuple[bool, SlotHeader | None]  # whether the index names a slot, and its entry's header
NOT_NAMED: Named = (False, None)


class IndexCursor:
    """The entries of one index, taken in rising slot order.

    Contract: ``entries`` yields ``(slot, header)`` in rising slot order, ``header`` None for
    an entry that is bad or names a slot past the end of the files (``index_entries``).
    ``at(slot)`` returns ``(True, header)`` when the index names ``slot`` and ``NOT_NAMED``
    otherwise; ``within(first, stop)`` returns the entries of slots ``first`` to ``stop - 1``
    in slot order. Each call asks about slots above every slot asked about before (a slot
    asked about again, or a lower one, raises ``ValueError``: the walk cannot go back).
    Entries of slots never asked about, passed over, are kept in ``passed``; ``rest()``
    returns them and every entry not reached yet, in slot order, and ends the walk.
    """

    def __init__(self, entries: Iterable[tuple[int, SlotHeader | None]]) -> None:
        self._entries: Iterator[tuple[int, SlotHeader | None]] = iter(entries)
        self._next: tuple[int, SlotHeader | None] | None = None
        self._floor = -1  # every slot up to this one was asked about or passed
        self.passed: list[tuple[int, SlotHeader | None]] = []
        self._advance()

    def _advance(self) -> None:
        self._next = next(self._entries, None)

    def _pass_below(self, first: int) -> None:
        if first <= self._floor:
            raise ValueError(f"slot {first} asked about after slot {self._floor}: the index "
                             "is walked in rising slot order only")
        while self._next is not None and self._next[0] < first:
            self.passed.append(self._next)
            self._advance()

    def at(self, slot: int) -> Named:
        self._pass_below(slot)
        self._floor = slot
        if self._next is not None and self._next[0] == slot:
            header = self._next[1]
            self._advance()
            return True, header
        return NOT_NAMED

    def within(self, first: int, stop: int) -> list[tuple[int, SlotHeader | None]]:
        if stop <= first:
            return []
        self._pass_below(first)
        self._floor = stop - 1
        found = []
        while self._next is not None and self._next[0] < stop:
            found.append(self._next)
            self._advance()
        return found

    def rest(self) -> list[tuple[int, SlotHeader | None]]:
        left, self.passed = self.passed, []
        while self._next is not None:
            left.append(self._next)
            self._advance()
        self._floor = 1 << 62
        return left
