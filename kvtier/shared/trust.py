"""Other writers whose copies keep proving bad, passed over for a while.

A writer's log names the chunks its slots hold; a reader believes it, and also writes no copy
of its own of a chunk another writer holds (the directory keeps one). A writer whose log
names chunks its slots do not hold (a broken engine, a disk that lost its writes, a hostile
co-writer naming every key it can compute) would then cost every reader a failed read for
each of those chunks and, worse, keep each reader from writing them: a miss for every
request, for as long as it names them again. Each copy proven bad is dropped when read
(``OtherWriters.read_failed``); a writer whose reads mostly prove bad is passed over whole
for ``DISTRUST_S``: its copies are not offered, so readers write their own.

A writer that reuses slots faster than a reader follows its log proves a few copies bad
among many good: it stays trusted. Only reads that prove a copy bad count against it (a
header or checksum that fails, a file gone), never an I/O error or a slow read.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

BAD_COPIES = 4  # copies of one writer proven bad within WINDOW_S, at the least, ...
BAD_SHARE = 0.5  # ... and more than this share of its copies read then: it is passed over
WINDOW_S = 60.0  # its reads are counted over this long, then afresh
DISTRUST_S = 300.0  # how long it is passed over (its copies are then read again, each checked)
MAX_WRITERS = 4096  # writers counted; past that, the one counted longest ago is forgotten


@dataclass
class _Reads:
    since: float
    good: int = 0
    bad: int = 0
    distrusted_until: float = 0.0


class WriterTrust:
    """Reads of each writer's copies, and the writers passed over.

    Contract: ``read(writer, bad)`` counts one read of a copy of ``writer`` (any hashable
    naming it: a disk path and writer id), ``bad`` when it proved the copy bad. Once, within
    ``WINDOW_S`` of its first counted read, ``BAD_COPIES`` reads of one writer proved bad
    and they are more than ``BAD_SHARE`` of its reads counted, ``trusted(writer)`` is False
    for ``DISTRUST_S``; then its counts start over. ``any_distrusted`` is True while some
    writer is passed over (a lookup may then look past a first copy). ``distrusted`` counts
    the times a writer was passed over. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._reads: OrderedDict[Hashable, _Reads] = OrderedDict()
        self._until = 0.0  # the last time any writer is passed over until
        self.distrusted = 0

    def read(self, writer: Hashable, bad: bool) -> bool:
        """Count the read; True when it made ``writer`` passed over."""
        now = self._clock()
        with self._lock:
            reads = self._reads.get(writer)
            if reads is None or (now - reads.since >= WINDOW_S and reads.distrusted_until <= now):
                reads = self._reads[writer] = _Reads(now)
                if len(self._reads) > MAX_WRITERS:
                    self._reads.popitem(last=False)
            self._reads.move_to_end(writer)
            if reads.distrusted_until > now:
                return False  # (a read under way when it was passed over)
            reads.bad += bad
            reads.good += not bad
            if reads.bad >= BAD_COPIES and reads.bad > BAD_SHARE * (reads.good + reads.bad):
                self._reads[writer] = _Reads(now, distrusted_until=now + DISTRUST_S)
                self._until = max(self._until, now + DISTRUST_S)
                self.distrusted += 1
                return True
            return False

    def trusted(self, writer: Hashable) -> bool:
        with self._lock:
            reads = self._reads.get(writer)
            return reads is None or reads.distrusted_until <= self._clock()

    @property
    def any_distrusted(self) -> bool:
        return self._until > self._clock()
