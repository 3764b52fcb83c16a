"""What the other writers of a shared cache directory hold: their segments of one namespace,
on every disk path, followed through their logs. Bookkeeping only: reads are
:class:`~kvtier.shared.reads.OtherReads`'."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence

from kvtier.io.answers import answers, ask
from kvtier.io.bounded_jobs import path_job_wait
from kvtier.io.root_looks import look_at_roots, stuck, under_way
from kvtier.keys import ChunkKey, Namespace
from kvtier.segment.index_file import MAX_SLOTS
from kvtier.shared.chunk_index import unpack
from kvtier.shared.followed import (
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
from kvtier.shared.view_logs import LogFollowing

log = logging.getLogger("kvtier")
COPIES_TRIED = 64  # copies of one key a lookup looks at, at most
_VIEWS = itertools.count()  # each view's looks are a kind of their own (``root_looks``)


class SharedView(LogFollowing):
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
    files (``EMFILE``), leaves it as it was. Each path's look is waited for
    ``path_job_wait(answer_timeout)`` at most (``look_at_roots``): one that answered and
    then hung below its top directory holds one refresh that long, once, and is passed
    over until that look ends; the other paths are followed meanwhile (``LogFollowing``).
    One refresh reads at most ``REFRESH_BYTES`` of log a path: each writer's share first,
    then what the others left to those with more.
    Every time is ``clock``'s. Each change to the view is O(1) (``ChunkIndex``). Memory is
    bounded by ``max_slots``, the slots the namespace's whole directory holds on one path
    (``directory_slots``): no writer's log names a slot past it, and the writers of a path
    together are followed in at most that many slots (their logs' further slots are passed
    over: misses, counted in ``passed_over``, said once). Thread-safe.
    """

    def __init__(self, roots: Sequence[str], namespace: Namespace, raw_bytes: int,
                 own: OwnSegments, lease_timeout: float, max_slots: int = MAX_SLOTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(roots, namespace, raw_bytes, lease_timeout, max_slots, clock)
        self.own, self.refreshes = own, 0
        self.max_writers = followable_writers(len(self._roots))
        self._listing = WriterListing(self._roots, namespace.id, self.max_writers)
        self._over_said = False  # whether passing over slots past max_slots was said
        self.answer_timeout: float | None = 10.0  # a path must answer within it (load_timeout)
        self._kind, self._late_said = f"kvtier-share-look {next(_VIEWS)}", False

    reclaimed = property(lambda self: self._upkeep.reclaimed)
    seats_freed = property(lambda self: self._upkeep.seats_freed)

    def find(self, key: ChunkKey) -> OtherChunk | None:
        return next(iter(self.copies(key, 1)), None)

    def copies(self, key: ChunkKey, most: int = 0) -> list[OtherChunk]:
        """At most ``most`` copies of ``key`` (0: every one), of the first ``COPIES_TRIED``
        the view knows (a writer may name one key in every slot of its segment: a lookup
        must not cost the step, under the view's lock, one pass over them all)."""
        found: list[OtherChunk] = []
        with self._lock:  # a copy of a segment no longer followed is dropped, never served
            gone = []
            for copy in itertools.islice(self._index.copies(key), COPIES_TRIED):
                chunk = chunk_of(self._sources, key, copy)
                if chunk is None:
                    gone.append(copy)
                    continue
                found.append(chunk)
                if len(found) == most:
                    break
            for copy in gone:
                self._index.remove(key, copy.source, copy.slot)
        return found

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
        for path, root in enumerate(self._roots):
            if answers(root, self.answer_timeout, fresh_s=0):  # asked before each look
                self._look(path, seats_due)
        self.refreshes += 1
        if not self._over_said and self.passed_over:
            self._over_said = True
            say_passed_over(self.max_slots)

    @property
    def passed_over(self) -> int:
        """Log records of slots passed over for want of room (``max_slots``), by writers followed."""
        with self._lock:
            return sum(f.follower.over for f in self._followed.values())

    def _look(self, path: int, seats_due: bool) -> None:
        """Path ``path``'s part of a refresh, bounded: past its wait it goes on alone (said
        once), and the path is passed over until it ends (``look_at_roots``)."""
        root, wait = self._roots[path], path_job_wait(self.answer_timeout)
        done = look_at_roots([root], lambda _: self._look_at(path, seats_due), wait, self._kind,
                             blocks_others=False)  # a slow look is no hung mount to the others
        if root not in done:
            if not self._late_said:
                self._late_said = True
                log.warning("kvtier: a look at other writers' segments on %s has not ended "
                            "within %g s (a mount that answered, then hung?): that path is "
                            "passed over until it ends, the others are followed", root, wait)
        elif isinstance(ended := done[root], BaseException):
            raise ended

    def _look_at(self, path: int, seats_due: bool) -> None:
        names = self._listing.names(path, self.own[path])
        if names is None:
            return  # a hung mount, or this process short of files: the view stays as it was
        if seats_due:
            self._upkeep.free_seats(path)
        with self._lock:  # gone, or made again since (another directory of that name)
            gone = [self._forget(k) for k, f in list(self._followed.items())
                    if k[0] == path and names.get(k[1]) != f.inode]
        for followed in gone:
            self._let_go(followed)
        self._follow(path, list(names))

    def close(self) -> bool:
        """Stop following; False when a path's look still runs (a hung mount), whose files
        are left open (their close would wait on the mount), to the process's exit."""
        late = under_way(self._kind)
        hung = {i for i, root in enumerate(self._roots) if root in late or stuck(root)}
        with self._lock:
            self._closed = True
            gone = [self._forget(key) for key in list(self._followed)]
        for followed in gone:
            if followed is not None and followed.path not in hung:
                self._let_go(followed)
        return not hung
