"""Opening a tier's disk paths under one writer id, each open bounded in time."""

from __future__ import annotations

import errno
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from kvtier.disk.opening import OpenArgs
from kvtier.io.bounded_jobs import path_job_wait
from kvtier.io.root_looks import look_at_roots, stuck, under_way
from kvtier.segment.cachedir import CacheDir, CacheDirError
from kvtier.segment.seat_reclaim import SeatReclaimer

Opened = tuple[CacheDir, int]  # the segment directory and its inode
_OPENERS = itertools.count()


@dataclass
class Search:
    """Where a search for a free writer id on one path ended: ``opened`` as ``writer``, or
    ``error`` (``writer`` None: no candidate got that far), and the ids found ``busy``."""

    writer: str | None = None
    opened: Opened | None = None
    error: OSError | None = None
    busy: set[str] = field(default_factory=set)

    def close(self) -> None:
        """Close what it opened (an open given up on: it must not keep the segment locked)."""
        if self.opened is not None:
            self.opened[0].close()


class PathOpener:
    """Contract: ``open(root, busy, bounded)`` opens ``root`` under this store's writer id
    once one of its paths has opened (``settled``), and until then under the first of
    ``OpenArgs.writers`` whose segment no other process holds (``busy`` gathers those across
    paths). ``writer`` becomes the candidate where the search stopped, even when that open
    fails for another reason (no seat free), but it is this store's own on a path only once
    it holds that segment there: another process may open it first, so a store none of
    whose paths ever opened looks for an id again at each try. When no seat is free, the
    seats of holders watched gone for ``lease_timeout`` since earlier tries are reclaimed
    (``SeatReclaimer``) and the open tried once more if any was freed.

    ``bounded``: the open runs on a thread of its own and is waited for
    ``path_job_wait(answer_timeout)``; one not over then (a mount that answered, then hung
    in the middle of the open) raises ``TimeoutError``, and what it opens later is closed.
    While it runs on, or a look of any kind at the root runs on past its deadline
    (``root_looks``), a bounded open of the same root raises ``TimeoutError`` at once (no
    second thread is left behind a hung mount). The search itself never touches this
    opener's state: the caller's thread applies it. ``open_many(roots, busy)``, once
    settled, opens ``roots`` at once, each bounded so (hung paths cost one wait together).
    """

    def __init__(self, args: OpenArgs) -> None:
        self.args = args
        self.writer = args.writers[0]
        self.settled = False
        self._seats = SeatReclaimer(args.lease_timeout)
        self._wait = path_job_wait(args.answer_timeout)
        self._kind = f"kvtier-open {next(_OPENERS)}"  # this opener's opens under way, by root

    def open(self, root: str, busy: set[str], bounded: bool = False) -> Opened:
        ended = self._bounded([root], busy)[root] if bounded else self._search(root, busy)()
        if isinstance(ended, BaseException):
            raise ended
        return self._apply(ended, busy)

    def open_many(self, roots: Sequence[str], busy: set[str]) -> dict[str, Opened | BaseException]:
        """Once ``settled``: each of ``roots`` opened at once, each bounded as ``open``'s
        (so hung paths cost one wait together): by root, its directory or what it raised
        (every outcome taken, so that what opened is the caller's to keep or close)."""
        assert self.settled, "the writer id is searched for one path at a time"
        opened: dict[str, Opened | BaseException] = {}
        for root, ended in self._bounded(roots, busy).items():
            try:
                opened[root] = ended if isinstance(ended, BaseException) else self._apply(ended, busy)
            except OSError as exc:
                opened[root] = exc
        return opened

    def _search(self, root: str, busy: set[str]) -> Callable[[], Search]:
        free = [w for w in self.args.writers if w not in busy] or list(self.args.writers[-1:])
        return partial(_search, partial(self._open_as, root),
                       [self.writer] if self.settled else free, not self.settled)

    def _bounded(self, roots: Sequence[str], busy: set[str]) -> dict[str, Search | BaseException]:
        """Each root's search on a thread of its own, all waited for ``_wait`` together."""
        if self._wait is None:
            return {root: self._search(root, busy)() for root in roots}
        searches, late = {root: self._search(root, busy) for root in roots}, under_way(self._kind)
        ended: dict[str, Search | BaseException] = {
            root: TimeoutError("an earlier open or look of it has not ended (a mount that "
                               "stopped answering after it answered?)")
            for root in roots if root in late or stuck(root)}
        done = look_at_roots([r for r in roots if r not in ended], lambda root: searches[root](),
                             self._wait, self._kind, Search.close)
        for root in roots:
            ended.setdefault(root, done.get(root, TimeoutError(
                f"no end to it within {self._wait:g} s (a mount that stopped answering in the "
                "middle of the open?)")))
        return ended

    def _apply(self, ended: Search, busy: set[str]) -> Opened:
        """The caller's thread takes a search's outcome: the ids found busy, the writer."""
        busy |= ended.busy
        self.writer = ended.writer or self.writer
        if ended.opened is None:
            assert ended.error is not None
            raise ended.error
        self.settled = True  # every path: the same writer
        return ended.opened

    def _open_as(self, root: str, writer: str) -> Opened:
        try:
            return self.args.open(root, writer)
        except CacheDirError as exc:
            if exc.errno != errno.EDQUOT \
                    or not self._seats.free_seats(root, self.args.namespace_id, writer):
                raise
        return self.args.open(root, writer)


def _search(open_as: Callable[[str], Opened], candidates: list[str], skip_busy: bool) -> Search:
    """Open as each of ``candidates`` in turn, past those whose segment another process of
    this host holds (EBUSY) while ``skip_busy`` and one is left."""
    ended = Search()
    for i, writer in enumerate(candidates):
        try:
            ended.opened, ended.writer = open_as(writer), writer
            return ended
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                ended.busy.add(writer)
                if skip_busy and i + 1 < len(candidates):
                    continue
            else:
                ended.writer = writer
            ended.error = exc
            return ended
    raise AssertionError("unreachable: the last candidate returns or raises")
