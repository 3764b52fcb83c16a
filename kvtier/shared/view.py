"""What the other writers of a shared cache directory hold: their segments of one namespace,
on every disk path, followed through their logs. Bookkeeping only: reads are
:class:`~kvtier.shared.reads.ForeignReads`'."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence

from kvtier.io.format import SlotHeader
from kvtier.io.safefs import SafeDir
from kvtier.keys import ChunkKey, Namespace
from kvtier.segment.index_file import MAX_SLOTS, open_segment_dir
from kvtier.segment.lease import MAX_LEASE_BYTES, LeaseInfo, LeaseWatch, beat_every
from kvtier.segment.lock import held_here
from kvtier.segment.log import LogChange
from kvtier.segment.names import LEASE_FILE
from kvtier.segment.seat_orphans import OrphanWatch, give_back_seats, orphan_seats
from kvtier.segment.seats import reclaim_segment
from kvtier.shared.followed import (
    Followed,
    ForeignChunk,
    WriterState,
    followable_writers,
)
from kvtier.shared.listing import WriterListing
from kvtier.shared.reads import SlotRef

log = logging.getLogger("kvtier")


class SharedView:
    """Chunks that other writers of ``namespace`` committed under ``roots``.

    Contract: ``refresh()`` (blocking I/O; run it off any hot path) lists each path's
    ``writers/`` (its first ``MAX_LISTED`` entries, of which the regular directories with a
    valid writer id other than ``own``: at most ``max_writers`` of them, ``MAX_WRITERS`` or
    fewer under a low open-file limit (``followable_writers``); junk is never counted),
    reads each writer's lease and what its log gained since the last refresh, and updates
    the view; a writer whose segment vanished is forgotten. ``find(key)``
    returns where another writer holds ``key`` (None when none does); ``drop(chunk)`` forgets
    a copy whose read failed, until its writer's log names that slot again. ``writers()``
    says who is there and who is live (``LeaseWatch``: a lease that changed within
    ``lease_timeout``). A writer's chunks stay readable after its lease expired, until its
    segment is reclaimed: by ``refresh`` itself, once this reader watched the lease stand still
    for ``lease_timeout`` and no process of this host holds the segment's lock
    (``reclaim_segment``: its files, then its seat; ``reclaimed`` counts them). Once per
    heartbeat interval it also gives back the seats that name no writer with a segment and
    that it watched stand unchanged for ``lease_timeout`` by its own clock (``OrphanWatch``;
    ``seats_freed`` counts them). A path that cannot be read holds nothing this time; a
    listing that fails for want of files or memory in this process (``EMFILE``) leaves the
    view as it was. Memory is bounded by ``max_slots``, the slots the namespace's whole
    directory holds on one path (``directory_slots``): no writer's log names a slot past it,
    and the writers of a path together are followed in at most that many slots (their logs'
    further slots are passed over: misses, counted in ``passed_over`` and said once).
    Thread-safe.
    """

    def __init__(self, roots: Sequence[str], namespace: Namespace, raw_bytes: int, own: str,
                 lease_timeout: float, max_slots: int = MAX_SLOTS) -> None:
        self._roots, self._ns, self._raw_bytes, self.own = list(roots), namespace, raw_bytes, own
        self.max_slots = max_slots
        self._digest = namespace.digest()
        self._watch = LeaseWatch(lease_timeout)
        self._lock = threading.Lock()
        self._followed: dict[tuple[int, str], Followed] = {}
        self._by_key: dict[ChunkKey, list[ForeignChunk]] = {}
        self.refreshes = 0
        self.bytes_read = 0
        self.reclaimed = 0
        self.seats_freed = 0
        self._reclaim_after: dict[tuple[int, str], float] = {}  # failed: not tried before
        self._seats_at = -math.inf  # when the seats were last looked at (monotonic)
        self._orphans = [OrphanWatch(lease_timeout) for _ in self._roots]
        self._failed = False
        self.max_writers = followable_writers(len(self._roots))
        self._listing = WriterListing(self._roots, namespace.id, self.max_writers)
        self._over_said = False  # whether passing over slots past max_slots was said

    # -- lookups ------------------------------------------------------------------------

    def find(self, key: ChunkKey) -> ForeignChunk | None:
        with self._lock:
            holders = self._by_key.get(key)
            return holders[0] if holders else None

    def find_at(self, key: ChunkKey, writer: str, path: int, slot: int) -> ForeignChunk | None:
        """``key`` as held by ``writer`` in that slot, if the view knows it there."""
        with self._lock:
            for chunk in self._by_key.get(key, ()):
                if (chunk.writer, chunk.path, chunk.slot) == (writer, path, slot):
                    return chunk
            return None

    def ref(self, chunk: ForeignChunk) -> SlotRef:
        """What a reader needs to read ``chunk`` (with its writer's log generation)."""
        return chunk.ref(self.generation(chunk.path, chunk.writer))

    def drop(self, chunk: ForeignChunk) -> None:
        with self._lock:
            self._remove(chunk.header.key, chunk.writer, chunk.path, chunk.slot)

    def generation(self, path: int, writer: str) -> int:
        """How many times that writer's log started over (its files may be new since)."""
        with self._lock:
            followed = self._followed.get((path, writer))
            return followed.generation if followed else -1

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)

    def writers(self) -> list[WriterState]:
        with self._lock:
            chunks: dict[str, int] = {}
            leases: dict[str, LeaseInfo | None] = {}
            live: dict[str, bool] = {}
            for (path, writer), followed in self._followed.items():
                chunks[writer] = chunks.get(writer, 0) + len(followed.follower.slots)
                leases[writer] = leases.get(writer) or followed.lease
                live[writer] = live.get(writer, False) or self._watch.live(f"{path}:{writer}")
            return [WriterState(w, live[w], chunks[w], leases[w]) for w in sorted(chunks)]

    # -- refresh ------------------------------------------------------------------------

    def refresh(self) -> None:
        seats_due = time.monotonic() - self._seats_at >= beat_every(self._watch.timeout)
        if seats_due:
            self._seats_at = time.monotonic()
        for path in range(len(self._roots)):
            if seats_due:
                self._free_seats(path)
            names = self._listing.names(path, self.own)
            if names is None:
                continue  # this process is short of files: the view stays as it was
            with self._lock:  # gone, or made again since (another directory of that name)
                gone = [k for k, f in self._followed.items()
                        if k[0] == path and names.get(k[1]) != f.inode]
                for key in gone:
                    self._forget(key)
            used = self._slots_followed(path)
            for writer in names:
                had = self._slots_of(path, writer)
                try:
                    self._refresh_one(path, writer, self.max_slots - (used - had))
                except Exception as exc:  # one writer's trouble must not stop the others'
                    if not self._failed:
                        log.warning("kvtier: following writer %s on %s failed: %r (further "
                                    "failures are not logged)", writer, self._roots[path], exc)
                    self._failed = True
                used += self._slots_of(path, writer) - had
        self.refreshes += 1
        self._say_over()

    @property
    def passed_over(self) -> int:
        """Log records of slots passed over for want of room (``max_slots``), by the
        writers followed now."""
        with self._lock:
            return sum(f.follower.over for f in self._followed.values())

    def _slots_of(self, path: int, writer: str) -> int:
        followed = self._followed.get((path, writer))
        return 0 if followed is None else len(followed.follower.slots)

    def _slots_followed(self, path: int) -> int:
        with self._lock:
            return sum(len(f.follower.slots) for (p, _), f in self._followed.items() if p == path)

    def _say_over(self) -> None:
        if not self._over_said and self.passed_over:
            self._over_said = True
            log.warning("kvtier: other writers' logs name more chunks than the shared "
                        "directory holds (%d slots a path, by disk_capacity); the rest are "
                        "not followed (misses). Give every engine on the directory the same "
                        "disk_capacity, or look for files kvtier did not write (kvtier verify)",
                        self.max_slots)

    def _free_seats(self, path: int) -> None:
        """Give back the seats of path ``path`` that name no writer with a segment and that
        this reader watched stand unchanged for ``lease_timeout`` (``OrphanWatch``): no
        writer would ever free them, and with every seat taken no writer could write."""
        try:
            with SafeDir.open(self._roots[path]) as top, top.subdir(self._ns.id) as ns_dir:
                due = self._orphans[path].due(orphan_seats(ns_dir, None))
                freed = give_back_seats(ns_dir, due)
        except OSError as exc:
            log.debug("kvtier: cannot look at the seats on %s: %s", self._roots[path], exc)
            return
        if freed:
            log.info("kvtier: gave back seats %s on %s (they named no writer with a segment "
                     "for %g s)", ", ".join(freed), self._roots[path], self._watch.timeout)
            self.seats_freed += len(freed)

    def _refresh_one(self, path: int, writer: str, room: int) -> None:
        """Follow ``writer`` on ``path`` one refresh further, knowing at most ``room`` of
        its slots."""
        key = (path, writer)
        followed = self._followed.get(key)
        try:
            if followed is None:
                followed = Followed(open_segment_dir(self._roots[path], self._ns.id, writer),
                                     self._digest, self._raw_bytes, self.max_slots)
                with self._lock:
                    self._followed[key] = followed
            try:
                lease_bytes = followed.dir.read_file(LEASE_FILE, MAX_LEASE_BYTES)
            except OSError:
                lease_bytes = None
            lease = LeaseInfo.parse(lease_bytes)  # never raises: a damaged lease is none
            before = followed.follower.bytes_read
            reset, changes = followed.follower.refresh(room=max(0, room))
        except OSError as exc:  # unsafe or vanished: what it held is not trusted any more
            log.debug("kvtier: cannot follow writer %s on %s: %s", writer, self._roots[path], exc)
            with self._lock:
                self._forget(key)
            return
        self.bytes_read += followed.follower.bytes_read - before
        if not self._watch.observe(f"{path}:{writer}", lease_bytes) \
                and self._reclaim(path, writer, followed):
            return
        with self._lock:
            followed.lease = lease
            if reset:
                followed.renew()
                self._drop_writer(path, writer, followed.follower.forgotten)
                changes = [LogChange(s, h) for s, h in followed.follower.slots.items()]
            self._apply(path, writer, changes)

    def _reclaim(self, path: int, writer: str, followed: Followed) -> bool:
        """Reclaim the segment of a writer that is gone; True when it is gone. One that
        cannot be reclaimed (a file of another user in it) is tried again once per
        ``lease_timeout``, and said once."""
        if held_here(followed.dir) or time.monotonic() < self._reclaim_after.get((path, writer), 0):
            return False
        try:
            with SafeDir.open(self._roots[path]) as top, top.subdir(self._ns.id) as ns_dir:
                done = reclaim_segment(ns_dir, writer, followed.inode)
        except OSError as exc:
            self._reclaim_failed(path, writer, str(exc), warn=True)
            return False
        if not done:  # entries kvtier did not write in it, or made again or locked meanwhile
            self._reclaim_failed(path, writer, "not proven free", warn=False)
        else:
            log.info("kvtier: reclaimed the segment of writer %s on %s (no heartbeat for "
                     "%.0f s)", writer, self._roots[path],
                     self._watch.idle_for(f"{path}:{writer}") or 0.0)
            self.reclaimed += 1
            with self._lock:
                self._forget((path, writer))
        return done

    def _reclaim_failed(self, path: int, writer: str, why: str, warn: bool) -> None:
        first = (path, writer) not in self._reclaim_after
        self._reclaim_after[(path, writer)] = time.monotonic() + self._watch.timeout
        log.log(logging.WARNING if warn and first else logging.DEBUG, "kvtier: could not reclaim the "
                "segment of writer %s on %s: %s (tried again every %g s)", writer,
                self._roots[path], why, self._watch.timeout)

    def _apply(self, path: int, writer: str, changes: list[LogChange]) -> None:
        for change in changes:
            if change.previous is not None:
                self._remove(change.previous.key, writer, path, change.slot)
            if change.header is not None:
                chunk = ForeignChunk(writer, path, change.slot, change.header)
                self._by_key.setdefault(change.header.key, []).append(chunk)

    def _remove(self, key: ChunkKey, writer: str, path: int, slot: int) -> None:
        holders = self._by_key.get(key)
        if not holders:
            return
        kept = [c for c in holders if (c.writer, c.path, c.slot) != (writer, path, slot)]
        if kept:
            self._by_key[key] = kept
        else:
            del self._by_key[key]

    def _drop_writer(self, path: int, writer: str, slots: list[tuple[int, SlotHeader]]) -> None:
        for slot, header in slots:
            self._remove(header.key, writer, path, slot)

    def _forget(self, key: tuple[int, str]) -> None:
        self._watch.forget(f"{key[0]}:{key[1]}")  # a writer gone: nothing kept of it
        self._reclaim_after.pop(key, None)
        followed = self._followed.pop(key, None)
        if followed is not None:
            self._drop_writer(*key, list(followed.follower.slots.items()))
            followed.close()

    def close(self) -> None:
        with self._lock:
            for key in list(self._followed):
                self._forget(key)
