"""Following the other writers of one namespace through their logs, one path at a time:
the state a ``SharedView`` keeps of them, and how a refresh moves it on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvtier.keys import ChunkKey, Namespace
from kvtier.segment.index_file import open_segment_dir
from kvtier.segment.lease import MAX_LEASE_BYTES, LeaseInfo, LeaseWatch
from kvtier.segment.log import RECORD_BYTES, REFRESH_BYTES, LogChange
from kvtier.segment.names import LEASE_FILE
from kvtier.shared.chunk_index import ChunkIndex, Copy
from kvtier.shared.followed import Followed
from kvtier.shared.upkeep import Upkeep

log = logging.getLogger("kvtier")
APPLY_BATCH = 4096  # log changes applied under the view's lock at once


class LogFollowing:
    """The writers a view follows and the chunks their logs name, under one lock.

    Contract (for ``SharedView``, which is one): ``_follow(path, names)`` moves each writer
    of ``names`` on ``path`` one refresh further (its lease, its log: at most
    ``REFRESH_BYTES`` of logs a path), following a writer it did not (a segment that cannot
    be opened is passed over), reclaiming one whose lease stood still (``Upkeep``) and
    letting go of one whose log cannot be read any more; ``_forget`` (lock held) and
    ``_let_go`` (not held) stop following a writer. Once ``_closed`` (set under the lock),
    nothing more is followed: a look that ends after the view closed opens nothing that
    stays open. Changes to the index go ``APPLY_BATCH`` a hold of the lock.
    """

    def __init__(self, roots: Sequence[str], namespace: Namespace, raw_bytes: int,
                 lease_timeout: float, max_slots: int, clock: Callable[[], float]) -> None:
        self._roots, self._ns, self._raw_bytes = list(roots), namespace, raw_bytes
        self.max_slots = max_slots
        self._digest = namespace.digest()
        self._watch = LeaseWatch(lease_timeout, clock)
        self._upkeep = Upkeep(self._roots, namespace.id, self._watch, clock)
        self._lock = threading.Lock()
        self._followed: dict[tuple[int, str], Followed] = {}
        self._sources: dict[int, Followed] = {}
        self._index = ChunkIndex()
        self.bytes_read, self._failed, self._closed = 0, False, False
        self._path_bytes: dict[int, int] = {}  # log bytes read by path (one look at a time each)
        self.on_let_go: Callable[[int, str], None] | None = None  # (path, writer) no longer followed

    def _follow(self, path: int, names: list[str]) -> None:
        """Each writer of ``names`` one refresh further: its lease, and its share of
        ``REFRESH_BYTES`` of log; then what the others left, to those with more."""
        left = REFRESH_BYTES
        share = max(RECORD_BYTES, left // max(1, len(names)))
        used = self._slots_followed(path)
        for first in (True, False):
            for writer in names:
                if self._closed:
                    return  # a look that ended after the view closed: nothing more is opened
                followed = self._followed.get((path, writer))
                if not first and (followed is None or not followed.follower.behind):
                    continue
                if not first and left < RECORD_BYTES:
                    return  # every lease was read: the rest of the logs waits
                before, had = self._path_bytes.get(path, 0), self._slots_of(path, writer)
                self._step(path, writer, self.max_slots - (used - had),
                           share if first else left, first)
                used += self._slots_of(path, writer) - had
                left -= self._path_bytes.get(path, 0) - before  # not another path's late look's

    def _step(self, path: int, writer: str, room: int, budget: int, first: bool) -> None:
        try:
            if first:
                self._refresh_one(path, writer, room, budget)
            else:
                self._read_log(self._followed[(path, writer)], room, budget)
        except Exception as exc:  # one writer's trouble must not stop the others'
            if not self._failed:
                log.warning("kvtier: following writer %s on %s failed: %r (further "
                            "failures are not logged)", writer, self._roots[path], exc)
            self._failed = True

    def _slots_of(self, path: int, writer: str) -> int:
        followed = self._followed.get((path, writer))
        return 0 if followed is None else len(followed.follower.slots)

    def _slots_followed(self, path: int) -> int:
        with self._lock:
            return sum(len(f.follower.slots) for (p, _), f in self._followed.items() if p == path)

    def _refresh_one(self, path: int, writer: str, room: int, budget: int) -> None:
        """Follow ``writer`` on ``path`` one refresh further (reading at most ``budget``
        bytes of its log), knowing at most ``room`` of its slots; reclaim its segment when
        its lease stood still that long."""
        key = (path, writer)
        followed = self._followed.get(key)
        if followed is None:
            try:
                directory = open_segment_dir(self._roots[path], self._ns.id, writer)
                followed = Followed(path, writer, directory, self._digest, self._raw_bytes,
                                    self.max_slots)
            except OSError as exc:  # unsafe or vanished
                log.debug("kvtier: cannot follow writer %s on %s: %s", writer,
                          self._roots[path], exc)
                return
            with self._lock:
                if not self._closed:
                    self._followed[key], self._sources[followed.source] = followed, followed
            if self._closed:
                followed.close()
                return
        try:
            lease_bytes = followed.dir.read_file(LEASE_FILE, MAX_LEASE_BYTES)
        except OSError:
            lease_bytes = None
        if not self._watch.observe(f"{path}:{writer}", lease_bytes) \
                and self._upkeep.may_reclaim(followed):
            with self._lock:  # let go first (``Upkeep``): followed again if it stays
                self._forget(key)
            self._let_go(followed)
            self._upkeep.reclaim(followed)
            return
        with self._lock:
            followed.lease = LeaseInfo.parse(lease_bytes)  # never raises: damaged is none
        self._read_log(followed, room, budget)

    def _read_log(self, followed: Followed, room: int, budget: int) -> None:
        """What ``followed``'s log gained, at most ``budget`` bytes of it, into the view."""
        follower = followed.follower
        before = follower.bytes_read
        try:
            reset, changes = follower.refresh(budget, room=max(0, room))
        except OSError as exc:  # unsafe or vanished: what it held is not trusted any more
            log.debug("kvtier: cannot follow writer %s on %s: %s", followed.writer,
                      self._roots[followed.path], exc)
            with self._lock:
                self._forget((followed.path, followed.writer))
            self._let_go(followed)
            return
        read = follower.bytes_read - before
        self._path_bytes[followed.path] = self._path_bytes.get(followed.path, 0) + read
        with self._lock:  # (a late look on another path may count beside this one)
            self.bytes_read += read
        if reset:
            with self._lock:
                followed.renew()
            self._drop_slots(followed.source, follower.forgotten())
        for start in range(0, len(changes), APPLY_BATCH):  # lookups get the lock in between
            with self._lock:
                if self._sources.get(followed.source) is followed:  # not forgotten since
                    self._apply(followed, changes[start:start + APPLY_BATCH])

    def _apply(self, followed: Followed, changes: list[LogChange]) -> None:
        source = followed.source
        for change in changes:
            if change.previous is not None:
                self._index.remove(change.previous, source, change.slot)
            if (header := change.header) is not None:
                self._index.put(header.key, Copy(source, change.slot, int(header.codec),
                                                 header.payload_bytes))

    def _drop_slots(self, source: int, slots: dict[int, ChunkKey]) -> None:
        """``source``'s copies in ``slots`` out of the index, ``APPLY_BATCH`` under the lock
        at a time: lookups get it in between (a copy not dropped yet: a miss at its read)."""
        items = list(slots.items())
        for start in range(0, len(items), APPLY_BATCH):
            with self._lock:
                for slot, key in items[start:start + APPLY_BATCH]:
                    self._index.remove(key, source, slot)

    def _forget(self, key: tuple[int, str]) -> Followed | None:
        """A writer no longer followed (lock held); ``_let_go`` it once the lock is released."""
        self._watch.forget(f"{key[0]}:{key[1]}")  # a writer gone: nothing kept of it
        self._upkeep.forget(*key)
        return self._followed.pop(key, None)

    def _let_go(self, followed: Followed | None) -> None:
        if followed is not None:  # every key it named: what it holds, what it dropped
            self._drop_slots(followed.source, followed.follower.slots)
            self._drop_slots(followed.source, followed.follower.forgotten())
            with self._lock:
                self._sources.pop(followed.source, None)
            followed.close()
            if self.on_let_go is not None:
                self.on_let_go(followed.path, followed.writer)
