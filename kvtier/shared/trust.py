"""Other writers whose logs keep naming chunks their slots do not hold, passed over for a while.

A writer's log names the chunks its slots hold; a reader believes it, and also writes no copy
of its own of a chunk another writer holds (the directory keeps one). A writer whose log
names chunks its slots do not hold (a broken engine, a disk that lost its writes, a hostile
co-writer naming every key it can compute) would then cost every reader a failed read for
each of those chunks and, worse, keep each reader from writing them: a miss for every
request, for as long as it names them again. A copy whose read proved it bad is dropped at
once (``OtherWriters.read_failed``) and kept here: it is read again only once its writer's
log names that chunk in that slot again, and if that read proves it bad too, the writer
named a chunk its slot did not hold, which counts against it. A writer with ``BAD_COPIES``
such copies within ``WINDOW_S``, more than half of its copies read then, is passed over
whole for ``DISTRUST_S``: its copies are not offered, so readers write their own.

An honest writer's bad copies are races: it overwrote or freed the slot after a reader's
view last read its log (a full disk evicting a whole prompt at once fails a reader's whole
load). Its log then names another chunk there, or none; and should it write that chunk
into that slot again, the read then checks out: neither counts. Nor does an I/O error or a
slow read. A writer no longer followed (its segment reclaimed) is forgotten: an engine that
takes its writer id again starts trusted.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

BAD_COPIES = 4  # copies of one writer proved bad again once named again, at the least, ...
BAD_SHARE = 0.5  # ... and more than this share of its copies read: it is passed over
WINDOW_S = 60.0  # a writer's copies are counted over this long, then afresh
DISTRUST_S = 300.0  # how long it is passed over (its copies are then read again, each checked)
MAX_WRITERS = 4096  # writers counted (a writer passed over is never forgotten early)
MAX_SUSPECTS = 4096  # copies proved bad once that are kept; past that, the oldest goes

Writer = tuple[int, str]  # a disk path and a writer id
Copy = tuple[int, str, int, bytes]  # a disk path, a writer id, a slot and the key named there


@dataclass
class _Reads:
    since: float
    good: int = 0
    bad: int = 0
    distrusted_until: float = 0.0


class WriterTrust:
    """Reads of each writer's copies, and the writers passed over.

    Contract: ``good(copy)`` counts a read of a copy (its writer's disk path and id, its
    slot, the key its writer named there) that checked out; ``bad(copy)`` one that proved
    it bad, and returns True when that made its writer passed over: a copy proved bad a
    second time (its writer named it again) counts against its writer, and once, within
    ``WINDOW_S`` of its first counted read, ``BAD_COPIES`` such copies are more than
    ``BAD_SHARE`` of its reads counted, ``trusted(writer)`` is False for ``DISTRUST_S``
    (then its counts start over). ``forget(writer)`` drops what is known of a writer (its
    segment is no longer followed). ``any_distrusted`` is True while some writer is passed
    over; ``distrusted`` counts the times one was. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._reads: OrderedDict[Writer, _Reads] = OrderedDict()
        self._suspects: OrderedDict[Copy, None] = OrderedDict()  # proved bad once
        self._until = 0.0  # the last time any writer is passed over until
        self.distrusted = 0

    def good(self, copy: Copy) -> None:
        with self._lock:
            self._suspects.pop(copy, None)  # named again, and there now: a race before
            reads = self._counted(copy[:2], self._clock())
            if reads is not None:
                reads.good += 1

    def bad(self, copy: Copy) -> bool:
        now, writer = self._clock(), copy[:2]
        with self._lock:
            if copy not in self._suspects:  # the first time: perhaps a race with its writer
                self._suspects[copy] = None
                if len(self._suspects) > MAX_SUSPECTS:
                    self._suspects.popitem(last=False)
                return False
            self._suspects.move_to_end(copy)
            reads = self._counted(writer, now)
            if reads is None:
                return False
            reads.bad += 1
            if reads.bad < BAD_COPIES or reads.bad <= BAD_SHARE * (reads.good + reads.bad):
                return False
            self._reads[writer] = _Reads(now, distrusted_until=now + DISTRUST_S)
            self._until = max(self._until, now + DISTRUST_S)
            self.distrusted += 1
            return True

    def _counted(self, writer: Writer, now: float) -> _Reads | None:
        """``writer``'s counts (lock held), afresh past ``WINDOW_S``; None while it is
        passed over (a read under way then counts for nothing)."""
        reads = self._reads.get(writer)
        if reads is not None and reads.distrusted_until > now:
            return None
        if reads is None or now - reads.since >= WINDOW_S:
            reads = self._reads[writer] = _Reads(now)
        self._reads.move_to_end(writer)
        if len(self._reads) > MAX_WRITERS:
            self._let_go_oldest(now)
        return reads

    def _let_go_oldest(self, now: float) -> None:
        """Forget the writer counted longest ago that is not passed over (never the one
        just counted: it is the last)."""
        for name, reads in self._reads.items():
            if reads.distrusted_until <= now:
                del self._reads[name]
                return

    def forget(self, writer: Writer) -> None:
        with self._lock:
            self._reads.pop(writer, None)
            for copy in [c for c in self._suspects if c[:2] == writer]:
                del self._suspects[copy]

    def trusted(self, writer: Writer) -> bool:
        with self._lock:
            reads = self._reads.get(writer)
            return reads is None or reads.distrusted_until <= self._clock()

    @property
    def any_distrusted(self) -> bool:
        return self._until > self._clock()
