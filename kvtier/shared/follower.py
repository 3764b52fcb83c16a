"""The other writers of a shared cache directory, followed: what they hold, kept fresh by a
thread, for a standalone store (one namespace) and for an engine's scheduler side (one
namespace per TP rank) alike."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.config.settings import KVTierConfig
from kvtier.io.answers import answer_wait
from kvtier.io.result import IOResult
from kvtier.keys import ChunkKey, Namespace
from kvtier.shared.followed import OwnSegments, WriterState, directory_slots
from kvtier.shared.misreads import Misreads, proves_bad
from kvtier.shared.reads import OtherReads, SlotRef
from kvtier.shared.refresh import RefreshThread
from kvtier.shared.trust import DISTRUST_S, Copy, WriterTrust
from kvtier.shared.view import SharedView

log = logging.getLogger("kvtier")
CLOSE_WAIT_S = 5.0  # how long closing waits for a refresh under way

Refs = tuple[SlotRef, ...]  # where another writer holds a chunk: one place per rank


@dataclass(frozen=True)
class FollowedCounts:
    """What the follower sees: rank 0's chunks and writers, and the segments reclaimed and
    seats given back by every rank's view."""

    chunks: int
    writers: int
    reclaimed: int
    seats_freed: int
    distrusted: int = 0  # times a writer whose copies kept proving bad was passed over


def _copy(refs: Refs) -> Copy:
    """Rank 0's copy, as ``WriterTrust`` names it."""
    return refs[0].path, refs[0].writer, refs[0].slot, refs[0].key


class OtherWriters:
    """Contract: ``find(key)`` returns, for each rank in order, where another writer holds
    ``key``: the same writer and slot on every rank, since a writer's ranks write the slots
    its scheduler side chose for all of them (None when no writer does, as of the last
    refresh). ``drop(refs)`` forgets such a copy until its writer's log names that slot
    again. ``read_failed(refs, proven)`` tells of a read of it that failed: ``proven`` (it
    proved the copy bad, ``misreads.proves_bad``) drops it; any other failure (an I/O error,
    a short read, a read not over in time) leaves it found, a miss for that load only, until
    ``MISSES_IN_A_ROW`` of them in a row drop it (True when dropped); ``read_ok(refs)``
    ends its run (``Misreads``). A writer whose log names again chunks its slots were read
    not to hold is passed over by ``find`` for a while (``WriterTrust``: ``trust``). ``read_many(items)``
    reads copies into memory, verified (blocking: an I/O thread), results never exceptions:
    only when made with ``reads``.
    ``own()`` names this process's writer id of each rank on each disk path (``OwnSegments``:
    those segments are its own; None where it holds none: every writer there is followed;
    it may change between refreshes). The views are refreshed by a thread once when made
    (waited for twice ``answer_wait(load_timeout)`` at most: a hung mount's is left to go
    on), then every ``share_refresh`` seconds, until ``close``. Thread-safe.
    """

    def __init__(self, config: KVTierConfig, namespaces: Sequence[Namespace], raw_bytes: int,
                 own: Callable[[], Sequence[OwnSegments]], reads: OtherReads | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        slots = directory_slots(raw_bytes, len(config.disk_paths), config.disk_capacity)
        self._own, self._reads = own, reads
        self._misreads = Misreads()
        self.trust = WriterTrust(clock)
        self.views = [SharedView(config.disk_paths, ns, raw_bytes, writer, config.lease_timeout,
                                 slots, clock=clock)
                      for ns, writer in zip(namespaces, own(), strict=True)]
        for view in self.views:
            view.answer_timeout = config.load_timeout
            view.on_let_go = self._let_go
        wait = answer_wait(config.load_timeout)  # a hung path's, then the other paths' looks
        self._thread = RefreshThread(self.refresh, config.share_refresh or 1.0,
                                     first_wait=None if wait is None else 2 * wait)

    def _let_go(self, path: int, writer: str) -> None:
        """A segment no longer followed (reclaimed, or gone): its files are closed before a
        reclaim deletes them, and what it proved is forgotten (its id may be taken again)."""
        if self._reads is not None:
            self._reads.kept.let_go_writer(path, writer)
        self.trust.forget((path, writer))

    def refresh(self) -> None:
        """Read what every other writer's log gained (blocking I/O: off any hot path)."""
        for view, writer in zip(self.views, self._own(), strict=True):
            view.own = writer
            view.refresh()
        if self._reads is not None:
            self._reads.kept.sweep()  # files of segments reclaimed since: their space goes back

    def refresh_soon(self) -> None:
        """Refresh in the background now rather than at the next period."""
        self._thread.soon()

    def find(self, key: ChunkKey) -> Refs | None:
        """Where another engine holds ``key`` on every rank, in one slot of one writer's
        segment on one path: of rank 0's copies (a chunk written again elsewhere after one
        rank's write of it failed leaves rank 0 a copy the others lack), the first every
        other rank holds there too."""
        trust = self.trust  # a writer passed over: its copies are not offered
        for first in self.views[0].copies(key, 0 if len(self.views) > 1 or trust.any_distrusted else 1):
            if not trust.trusted((first.path, first.writer)):
                continue
            chunks = [first]
            for view in self.views[1:]:
                if (chunk := view.find_at(key, first.writer, first.path, first.slot)) is None:
                    break
                chunks.append(chunk)
            else:
                return tuple(view.ref(chunk) for view, chunk in zip(self.views, chunks, strict=True))
        return None

    def read_failed(self, refs: Refs, proven: bool) -> bool:
        if proven or self._misreads.missed(refs):
            self.drop(refs)
            if proven and self.trust.bad(_copy(refs)):
                log.warning("kvtier shared directory: writer %r on disk path %d names again "
                            "chunks its slots were read not to hold; its copies are passed over "
                            "for %.0f s, and this engine writes its own", refs[0].writer,
                            refs[0].path, DISTRUST_S)
            return True
        return False

    def read_ok(self, refs: Refs) -> None:
        self._misreads.forget(refs)
        self.trust.good(_copy(refs))

    def read_over(self, refs: Refs, result: IOResult) -> None:
        """``read_ok`` or ``read_failed`` of ``refs``, as ``result`` says."""
        if result.ok:
            self.read_ok(refs)
        else:
            self.read_failed(refs, proves_bad(result))

    def drop(self, refs: Refs) -> None:
        self._misreads.forget(refs)
        for view, ref in zip(self.views, refs, strict=True):
            chunk = view.find_at(ChunkKey(ref.key), ref.writer, ref.path, ref.slot)
            if chunk is not None:
                view.drop(chunk)

    def read_many(self, items: list[tuple[Refs, np.ndarray]]) -> list[IOResult]:
        """Read rank 0's copy of each chunk into its buffer, verified."""
        assert self._reads is not None, "a follower made without reads reads nothing"
        return self._reads.read_many([(refs[0], dst) for refs, dst in items])

    def writers(self) -> list[WriterState]:
        return self.views[0].writers()

    def counts(self) -> FollowedCounts:
        return FollowedCounts(len(self.views[0]), len(self.views[0].writers()),
                              sum(v.reclaimed for v in self.views),
                              sum(v.seats_freed for v in self.views), self.trust.distrusted)

    def close(self, timeout: float | None = CLOSE_WAIT_S) -> bool:
        """Stop refreshing, waiting at most ``timeout`` for a refresh under way; one still
        running then (a hung mount) keeps the views' files open, left to the process's exit,
        and False is returned."""
        if not self._thread.close(timeout):
            log.warning("kvtier: a look at other writers' segments has not ended in %s s (a "
                        "hung mount?): its files stay open until the process exits", timeout)
            return False
        closed = all([view.close() for view in self.views])  # every view, then
        if not closed:  # a path whose look still runs: its files' close would wait on it
            log.warning("kvtier: a look at other writers' segments on a disk path has not ended "
                        "(a hung mount?): their files stay open until the process exits")
        elif self._reads is not None:
            self._reads.close()
        return closed


def follow_others(config: KVTierConfig, namespaces: Sequence[Namespace], raw_bytes: int,
                  own: Callable[[], Sequence[OwnSegments]], reads: OtherReads | None = None,
                  ) -> OtherWriters | None:
    """The follower of the other writers of ``namespaces`` (one per rank), or None: no
    disk paths, or ``share_refresh`` off (a private cache)."""
    if not config.disk_paths or config.share_refresh is None:
        return None
    return OtherWriters(config, namespaces, raw_bytes, own, reads)
