"""What the other writers of a shared cache directory hold: their segments of one namespace,
on every disk path, followed through their logs. Bookkeeping only: reads are
:class:`~kvtier.shared.reads.OtherReads`'."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvtier.io.answers import answers, ask
from kvtier.keys import ChunkKey, Namespace
from kvtier.segment.index_file import MAX_SLOTS, open_segment_dir
from kvtier.segment.lease import MAX_LEASE_BYTES, LeaseInfo, LeaseWatch
from kvtier.segment.log import RECORD_BYTES, REFRESH_BYTES, LogChange
from kvtier.segment.names import LEASE_FILE
from kvtier.shared.chunk_index import ChunkIndex, Copy, unpack
from kvtier.shared.followed import (
    Followed,
    OtherChunk,
    OwnSegments,
    WriterState,
    chunk_of,
    followable_writers,
    say_passed_over,
    writer_states,
)
from kvtier.shared.listing import WriterListing
from kvtier.shared.reads import SlotRef
from kvtier.shared.upkeep import Upkeep

log = logging.getLogger("kvtier")
APPLY_BATCH = 4096  # log changes applied under the view's lock at once


class SharedView:
    """Chunks that other writers of ``namespace`` committed under ``roots``.

    Contract: ``refresh()`` (blocking I/O; run it off any hot path) lists each path's
    ``writers/`` (its first ``MAX_LISTED`` entries, of which the regular directories with a
    valid writer id other than ``own[path]``, this process's segment there if it holds one
    (``OwnSegments``): at most ``max_writers``, fewer under a low open-file limit
    (``followable_writers``), segments first: junk never hides one, ``WriterListing``),
    reads each writer's lease and what its log gained since the last refresh, and updates
    the view; a writer whose segment vanished is forgotten. ``find(key)`` returns where
    another writer holds ``key`` (None if none), ``copies(key)`` every place (``find``'s
    first); ``drop(chunk)`` forgets a copy until its writer's log names that slot again.
    ``writers()`` says who is there and who is live (``LeaseWatch``: a lease that changed
    within ``lease_timeout``). A writer's chunks stay readable after its lease expired,
    until its segment is reclaimed (``Upkeep``): by ``refresh`` itself, once this reader
    watched the lease stand still for ``lease_timeout`` and no process of this host holds
    the segment's lock; the view lets go of the segment first (followed again if it stays).
    ``on_let_go(path, writer)``, when set, hears of each segment the view stops following,
    to close its files. Once per heartbeat interval it also gives back the seats that name
    no writer with a segment and that it watched stand unchanged for ``lease_timeout``
    (``OrphanWatch``; ``seats_freed``). A path that cannot be read holds nothing this time;
    one that does not answer within ``answer_timeout`` (a hung mount: asked before each
    look, as one that hung since would hold this thread for good), or a listing short of
    files (``EMFILE``), leaves it as it was. One refresh reads at most ``REFRESH_BYTES`` of
    log a path: each writer's share first, then what the others left to those with more.
    Every time is ``clock``'s. Each change to the view is O(1) (``ChunkIndex``). Memory is
    bounded by ``max_slots``, the slots the namespace's whole directory holds on one path
    (``directory_slots``): no writer's log names a slot past it, and the writers of a path
    together are followed in at most that many slots (their logs' further slots are passed
    over: misses, counted in ``passed_over``, said once). Thread-safe.
    """

    def __init__(self, roots: Sequence[str], namespace: Namespace, raw_bytes: int,
                 own: OwnSegments, lease_timeout: float, max_slots: int = MAX_SLOTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._roots, self._ns, self._raw_bytes, self.own = list(roots), namespace, raw_bytes, own
        self.max_slots = max_slots
        self._digest = namespace.digest()
        self._watch = LeaseWatch(lease_timeout, clock)
        self._upkeep = Upkeep(self._roots, namespace.id, self._watch, clock)
        self._lock = threading.Lock()
        self._followed: dict[tuple[int, str], Followed] = {}
        self._sources: dict[int, Followed] = {}
        self._index = ChunkIndex()
        self.refreshes, self.bytes_read, self._failed = 0, 0, False
        self.max_writers = followable_writers(len(self._roots))
        self._listing = WriterListing(self._roots, namespace.id, self.max_writers)
        self._over_said = False  # whether passing over slots past max_slots was said
        self.on_let_go: Callable[[int, str], None] | None = None  # (path, writer) no longer followed
        self.answer_timeout: float | None = 10.0  # a path must answer within it (load_timeout)

    reclaimed = property(lambda self: self._upkeep.reclaimed)
    seats_freed = property(lambda self: self._upkeep.seats_freed)

    def find(self, key: ChunkKey) -> OtherChunk | None:
        return next(iter(self.copies(key, 1)), None)

    def copies(self, key: ChunkKey, most: int = 0) -> list[OtherChunk]:  # most 0: every one
        with self._lock:  # a copy of a segment no longer followed is dropped, never served
            chunks = [(copy, chunk_of(self._sources, key, copy)) for copy in self._index.copies(key)]
            for copy in [copy for copy, chunk in chunks if chunk is None]:
                self._index.remove(key, copy.source, copy.slot)
        return [chunk for _, chunk in chunks if chunk is not None][:most or None]

    def find_at(self, key: ChunkKey, writer: str, path: int, slot: int) -> OtherChunk | None:
        """``key`` as held by ``writer`` in that slot, if the view knows it there."""
        with self._lock:
            followed = self._followed.get((path, writer))
            copy = None if followed is None else self._index.at(key, followed.source, slot)
            return None if copy is None else chunk_of(self._sources, key, copy)

    def ref(self, chunk: OtherChunk) -> SlotRef:
        """What a reader needs to read ``chunk``, with how many times its writer's log started
        over (its files may be new since)."""
        with self._lock:
            followed = self._followed.get((chunk.path, chunk.writer))
            return chunk.ref(followed.generation if followed else -1)

    def drop(self, chunk: OtherChunk) -> None:
        with self._lock:
            if (followed := self._followed.get((chunk.path, chunk.writer))) is not None:
                self._index.remove(chunk.key, followed.source, chunk.slot)

    def listen(self, listener: Callable[[ChunkKey, OtherChunk | None], None]) -> list[OtherChunk]:
        """Call ``listener`` (on the refresh thread, under the view's lock: keep it short)
        with (key, a copy) when a key gains its first copy, (key, None) when it loses its
        last; returns what the view held then, one copy a key (made into chunks outside it)."""
        with self._lock:
            self._index.listener = lambda key, copy: listener(
                key, None if copy is None else chunk_of(self._sources, key, copy))
            held, sources = self._index.packed_items(), dict(self._sources)
        chunks = (chunk_of(sources, key, unpack(packed)) for key, packed in held)
        return [chunk for chunk in chunks if chunk is not None]

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def writers(self) -> list[WriterState]:
        with self._lock:
            return writer_states(self._followed, lambda p, w: self._watch.live(f"{p}:{w}"))

    def refresh(self) -> None:
        seats_due = self._upkeep.seats_due()
        ask(self._roots, self.answer_timeout, fresh_s=0)  # all at once: hung ones cost one wait
        for path in range(len(self._roots)):
            answered = answers(self._roots[path], self.answer_timeout, fresh_s=0)  # each look
            names = self._listing.names(path, self.own[path]) if answered else None
            if names is None:
                continue  # a hung mount, or this process short of files: the view stays as it was
            if seats_due:
                self._upkeep.free_seats(path)
            with self._lock:  # gone, or made again since (another directory of that name)
                gone = [self._forget(k) for k, f in list(self._followed.items())
                        if k[0] == path and names.get(k[1]) != f.inode]
            for followed in gone:
                self._let_go(followed)
            self._follow(path, list(names))
        self.refreshes += 1
        if not self._over_said and self.passed_over:
            self._over_said = True
            say_passed_over(self.max_slots)

    def _follow(self, path: int, names: list[str]) -> None:
        """Each writer of ``names`` one refresh further: its lease, and its share of
        ``REFRESH_BYTES`` of log; then what the others left, to those with more."""
        left = REFRESH_BYTES
        share = max(RECORD_BYTES, left // max(1, len(names)))
        used = self._slots_followed(path)
        for first in (True, False):
            for writer in names:
                followed = self._followed.get((path, writer))
                if not first and (followed is None or not followed.follower.behind):
                    continue
                if not first and left < RECORD_BYTES:
                    return  # every lease was read: the rest of the logs waits
                before, had = self.bytes_read, self._slots_of(path, writer)
                self._step(path, writer, self.max_slots - (used - had),
                           share if first else left, first)
                used += self._slots_of(path, writer) - had
                left -= self.bytes_read - before

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

    @property
    def passed_over(self) -> int:
        """Log records of slots passed over for want of room (``max_slots``), by writers followed."""
        with self._lock:
            return sum(f.follower.over for f in self._followed.values())

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
                self._followed[key], self._sources[followed.source] = followed, followed
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
        self.bytes_read += follower.bytes_read - before
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

    def close(self) -> None:
        with self._lock:
            gone = [self._forget(key) for key in list(self._followed)]
        for followed in gone:
            self._let_go(followed)
