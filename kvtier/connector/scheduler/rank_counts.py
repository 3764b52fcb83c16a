"""Folding the workers' reports: outcomes counted over TP ranks, which report in different
steps (a background disk write ends when it ends), until every rank has spoken."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable


class RankOutcomes:
    """Per key, how many ranks succeeded and failed so far.

    Contract: ``add(key, done, failed)`` adds one report's counts and returns None while
    ranks are still to report, then (once ``world_size`` have) True when none failed, and
    forgets the key.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._counts: dict[Hashable, list[int]] = {}

    def add(self, key: Hashable, done: int, failed: int) -> bool | None:
        counts = self._counts.setdefault(key, [0, 0])
        counts[0] += done
        counts[1] += failed
        if counts[0] + counts[1] < self.world_size:
            return None
        del self._counts[key]
        return counts[1] == 0


class RankCount:
    """Per key, a count of ranks that goes up and down (ranks that finished a load, whose
    given-up read still runs, or that have a disk path out of service).

    Contract: ``up(key, ranks)`` returns True when the key's count rose from zero;
    ``down(key, ranks)`` returns True when it fell to zero (the key is then forgotten);
    ``reached(key, ranks, total)`` adds ranks and returns True, forgetting the key, once
    ``total`` have been counted.
    """

    def __init__(self) -> None:
        self._counts: Counter = Counter()

    def __getitem__(self, key: Hashable) -> int:
        return self._counts[key]

    def up(self, key: Hashable, ranks: int) -> bool:
        was = self._counts[key]
        self._counts[key] += ranks
        return not was and self._counts[key] > 0

    def down(self, key: Hashable, ranks: int) -> bool:
        self._counts[key] -= ranks
        if self._counts[key] > 0:
            return False
        del self._counts[key]
        return True

    def reached(self, key: Hashable, ranks: int, total: int) -> bool:
        self._counts[key] += ranks
        if self._counts[key] < total:
            return False
        del self._counts[key]
        return True
