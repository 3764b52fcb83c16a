"""Fetching the chunks of a ``get``: pinned where they are hottest, disk chunks read in
parallel and verified (into host slots, or straight into the caller's tensor), each read
bounded by ``load_timeout``."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from functools import partial

import numpy as np

from kvtier.io.batch_reads import READ_GROUP_BYTES, BatchReads
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.shared.view import ForeignChunk
from kvtier.store.direct import DirectTarget
from kvtier.store.staging import Stagings
from kvtier.store.state import DISK, HOST, REMOTE, SHARED, Skip, StoreShared
from kvtier.store.writes import PlanRunner
from kvtier.tiers.stack import Location, StorePlan
from kvtier.units import time_left


class FetchState(Enum):
    HOT = "hot"  # in a memory tier: copy from ``loc``
    READING = "reading"  # its disk read (into ``plan.dst`` or ``direct``) is in flight
    STAGED = "staged"  # the read checked out: copy from ``plan.dst`` (pinned)
    LANDED = "landed"  # the read into the caller's tensor checked out: nothing to copy
    FAILED = "failed"  # the read failed: the chunk was dropped
    GIVEN_UP = "given up"  # not over by its deadline, or not needed any more


@dataclass
class Fetch:
    """One chunk of a ``get``: where it is pinned (``loc``), and, from disk, its read into
    a host slot (``plan.dst``) or straight into the caller's tensor (``direct``: the target
    and the chunk's place in it)."""

    key: ChunkKey
    loc: Location
    state: FetchState = FetchState.HOT
    read: Future | None = None
    plan: StorePlan | None = None  # the host slot the read fills
    deadline: float | None = None  # time.monotonic() by which the read must be over
    direct: tuple[DirectTarget, int] | None = None
    foreign: ForeignChunk | None = None  # in another writer's segment (``loc.tier`` SHARED)

    def target(self) -> Location | list[np.ndarray]:
        """Where the read lands: the host slot, or the pieces of the caller's tensor."""
        if self.direct is not None:
            target, index = self.direct
            return target.pieces(index)
        assert self.plan is not None, "a disk read lands in a host slot or the caller's tensor"
        return self.plan.dst


def _fingerprint(key: ChunkKey) -> int:
    return int.from_bytes(key[:8], "little") | 1  # never 0, the mark of "not read yet"


class Fetcher:
    """Starts and completes the fetches of a ``get``.

    Contract: ``begin(key, direct)`` pins the chunk where it is hottest and, from disk,
    reserves a host slot for its read (``Skip.NO_ROOM`` when no host slot is free,
    ``Skip.BUSY`` when another ``get`` is reading it into one: ``wait_staged(key)``, then
    begin again; ``Skip.END`` when the prefix ends there), or with a ``direct`` target
    reads it straight there on the chunk's first read from disk (its second one goes
    through a host slot, which promotes it); ``start(fetches)`` starts the reads of fetches
    begun, grouped;
    ``complete(fetch)`` says where the chunk can be copied from (for a direct read: its disk
    slot, the bytes being in place), or None when its read failed (the chunk is dropped) or
    was not over in time (a direct read's pages are then detached from the caller);
    ``release(*fetches)`` unpins what ``begin`` and ``complete`` pinned.
    """

    def __init__(self, shared: StoreShared, runner: PlanRunner) -> None:
        self.shared, self.runner = shared, runner
        # per disk slot, the fingerprint of the chunk last read from it straight into a
        # caller's tensor (lock held): its next read promotes it
        self._read_direct = np.zeros(shared.lane.num_slots, dtype=np.uint64)
        self.stagings = Stagings(shared.lock)  # host slots reserved for reads, until finished

    def hold_disk_chunks(self, keys: list[ChunkKey]) -> list[tuple[ChunkKey, Location]]:
        """Pin the disk copies of the cached prefix of ``keys`` for a whole ``get`` (of the
        chunks in host memory too): making room in host memory for one read demotes host
        chunks to disk, which must not evict a later chunk of the same prefix from both."""
        if not self.shared.lane.num_slots:
            return []  # no disk tier
        with self.shared.lock:
            return self.shared.stack.pin_prefix(keys, DISK)

    def begin(self, key: ChunkKey, direct: tuple[DirectTarget, int] | None = None,
              remote: bool = False) -> Fetch | Skip:
        """Pin ``key`` where it is hottest; from disk, another writer's segment or the
        remote store (``remote``: it said it holds the chunk), choose where its read lands.

        ``END`` when the key is not cached or its host slot's previous chunk could not be
        written back in time (a hung drive), ``NO_ROOM`` when no host slot is free for it,
        ``BUSY`` when another ``get`` is reading it into host memory.
        """
        foreign = None
        with self.shared.lock:
            loc = self.shared.stack.locate(key)
            if loc is None:
                foreign = self.shared.others.find(key) if self.shared.others else None
                if foreign is None and not remote:
                    return Skip.END
                # nothing to pin: not ours
                loc = Location(SHARED, foreign.slot) if foreign else Location(REMOTE, -1)
            else:
                self.shared.stack.indexes[loc.tier].pin(key)
            if loc.tier not in (DISK, SHARED, REMOTE):
                return Fetch(key, loc)
            if direct is not None and loc.tier is DISK and self._read_direct[loc.slot] != _fingerprint(key):
                return Fetch(key, loc, FetchState.READING, direct=direct)
            plan = self.shared.stack.plan_store(key, HOST)
            if plan is None:
                self._unpin(key, loc)
                return Skip.BUSY if self.stagings.busy(key) else Skip.NO_ROOM
            self.stagings.begin(plan)
        try:
            demoted = self.runner.demote(plan)
        except BaseException:  # the engine closed meanwhile: its reservations are finished
            with self.shared.lock:
                self._unpin(key, loc)
                self.stagings.end(plan)
            raise
        if not demoted:  # a hung drive: end the prefix here, the chunk stays cached
            with self.shared.lock:
                self._unpin(key, loc)
                self.stagings.end(plan)  # whoever waits for it: no read is coming
            return Skip.END
        return Fetch(key, loc, FetchState.READING, None, plan, foreign=foreign)

    def _unpin(self, key: ChunkKey, loc: Location) -> None:
        if loc.tier not in (SHARED, REMOTE):
            self.shared.stack.unpin(key, loc)

    def wait_staged(self, key: ChunkKey, timeout: float | None) -> bool:
        """Wait (lock not held) until no ``get`` is reading ``key`` into a host slot; False
        when one still is after ``timeout`` seconds."""
        return self.stagings.wait(key, timeout)

    def _staged(self, plan: StorePlan, ok: bool) -> None:
        """Finish the host slot reserved for a chunk's read (lock held)."""
        self.shared.stack.finish(plan.key, plan.dst, ok)
        self.stagings.end(plan)

    def start(self, fetches: list[Fetch]) -> None:
        """Start the disk reads of fetches ``begin`` reserved: a job per path and group of
        up to ``READ_GROUP_BYTES`` (neighbouring slots move in one call; small chunks read
        one by one lose more to the hand-offs between threads than they gain in
        parallel). Every fetch gets its read, whatever fails."""
        reading = sorted((f for f in fetches if f.state is FetchState.READING and f.read is None),
                         key=lambda f: f.loc.slot)
        if not reading:
            return
        timeout = self.shared.config.load_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        from_remote = [f for f in reading if f.loc.tier is REMOTE]
        reading = [f for f in reading if f.loc.tier is not REMOTE]
        try:
            self._start_disk(reading, deadline)
        finally:  # every fetch gets its read, whatever fails
            if from_remote:
                self._start_remote(from_remote, deadline)

    def _start_disk(self, reading: list[Fetch], deadline: float | None) -> None:
        lane = self.shared.lane
        per_group = max(1, READ_GROUP_BYTES // self.shared.transfers.chunk_bytes)
        groups: list[tuple[str, list[Fetch], BatchReads]] = []
        for i, queue in enumerate(lane.queues):
            for theirs in (False, True):  # a group reads this store's slots or other writers'
                mine = [f for f in reading
                        if self._queue_index(f) == i and (f.foreign is not None) == theirs]
                groups += self._groups(queue, mine, per_group, deadline)
        for i, (queue, group, reads) in enumerate(groups):
            try:
                job = lane.submit(queue, partial(reads.run, self._reader(group)))
            except BaseException as exc:  # closed meanwhile: this read and the later ones fail
                for _, _, unstarted in groups[i:]:
                    unstarted.fail(repr(exc))
                raise
            reads.watch(job)

    def _start_remote(self, fetches: list[Fetch], deadline: float | None) -> None:
        """Start the reads of chunks from the remote store, a job (one round trip) per
        group of up to the tier's ``read_group_bytes``."""
        remote = self.shared.remote
        assert remote is not None, "chunks come from the remote store only with one"
        per_group = max(1, remote.tier.read_group_bytes // self.shared.transfers.chunk_bytes)
        groups = self._groups("", fetches, per_group, deadline)
        for i, (_, group, reads) in enumerate(groups):
            pairs = [(f.key, f.plan.dst.slot) for f in group if f.plan is not None]
            try:
                job = remote.lane.submit(partial(reads.run, partial(remote.get, pairs)))
            except BaseException as exc:  # closed meanwhile: this read and the later ones fail
                for _, _, unstarted in groups[i:]:
                    unstarted.fail(repr(exc))
                raise
            reads.watch(job)

    @staticmethod
    def _groups(queue: str, fetches: list[Fetch], per_group: int,
                deadline: float | None) -> list[tuple[str, list[Fetch], BatchReads]]:
        """``fetches`` in groups of ``per_group``, each with its futures handed out."""
        groups = []
        for first in range(0, len(fetches), per_group):
            group = fetches[first:first + per_group]
            reads = BatchReads(len(group))
            for fetch, read in zip(group, reads.items, strict=True):
                fetch.read, fetch.deadline = read, deadline
            groups.append((queue, group, reads))
        return groups

    def _queue_index(self, fetch: Fetch) -> int:
        """The disk path a fetch reads from (another writer's chunks: the same path)."""
        paths = len(self.shared.lane.queues)
        return (fetch.foreign.path if fetch.foreign else fetch.loc.slot) % paths

    def _reader(self, group: list[Fetch]) -> Callable[[], list[IOResult]]:
        """The read of one group: from this store's disk slots or from another writer's."""
        if group[0].foreign is not None:
            others = self.shared.others
            assert others is not None, "chunks of other writers come from their followers"
            pairs = [(f.foreign, f.plan.dst) for f in group if f.foreign and f.plan]
            return partial(others.read_many, pairs)
        items = [(f.key, f.loc, f.target()) for f in group]
        return partial(self._read_and_blank, items)

    def _read_and_blank(self, items: list) -> list[IOResult]:
        """Verified disk reads (an I/O thread); a corrupt slot's header is blanked in the
        same job, so a get's wait on it is bounded by ``load_timeout`` like the read's, and
        the slot stays pinned until both are over."""
        results = self.shared.transfers.read_many(items)
        for (_, loc, _), result in zip(items, results, strict=True):
            if result.status is IOStatus.CORRUPT:
                self.shared.lane.invalidate(loc.slot)
        return results

    def complete(self, fetch: Fetch) -> Location | None:
        """Where the chunk can be copied from, or ``None`` when its disk read failed or was
        not over by its deadline (``load_timeout`` after it was started).

        A successful read makes the host copy visible and pins it for the fetch; a failed
        one drops the disk copy (and blanks a corrupt slot's header).
        """
        if fetch.state is FetchState.HOT:
            return fetch.loc
        if fetch.state is FetchState.LANDED:
            return fetch.loc
        if fetch.state is not FetchState.READING:
            return fetch.plan.dst if fetch.state is FetchState.STAGED and fetch.plan else None
        read, plan = fetch.read, fetch.plan
        assert read is not None, "a fetch from disk has its read started"
        try:
            result = read.result(timeout=time_left(fetch.deadline))
        except TimeoutError:
            self._give_up(fetch, timed_out=True)
            return None
        except Exception as exc:  # a bug or an unexpected error: a miss, never a crash
            result = IOResult(IOStatus.IO_ERROR, detail=repr(exc))
        except BaseException:  # the wait was interrupted: the read may still land
            self._give_up(fetch, timed_out=False)
            raise
        if fetch.foreign is not None:
            return self._complete_foreign(fetch, result)
        if fetch.loc.tier is REMOTE:
            return self._complete_remote(fetch, result)
        with self.shared.lock:
            if plan is not None:
                self._staged(plan, result.ok)
            if result.ok:
                self.shared.stats.disk_reads += 1
                self.shared.stats.disk_read_bytes += result.nbytes
                if plan is None:
                    self._read_direct[fetch.loc.slot] = _fingerprint(fetch.key)
                    fetch.state = FetchState.LANDED
                    return fetch.loc
                self.shared.stack.indexes[HOST].pin(fetch.key)
                self.shared.stats.chunks_promoted += 1  # disk to host: it stays there
                fetch.state = FetchState.STAGED
                return plan.dst
            fetch.state = FetchState.FAILED
            self.shared.stack.discard(fetch.key)
            self.shared.account_failure(result, "read")
        return None

    def _complete_foreign(self, fetch: Fetch, result: IOResult) -> Location | None:
        """A read from another writer's segment: the chunk is now in this store's host
        memory, or that copy is forgotten (the writer overwrote or lost it meanwhile)."""
        plan, others, foreign = fetch.plan, self.shared.others, fetch.foreign
        assert plan is not None and others is not None and foreign is not None
        with self.shared.lock:
            self._staged(plan, result.ok)
            if result.ok:
                self.shared.stats.shared_reads += 1
                self.shared.stats.shared_read_bytes += result.nbytes
                self.shared.stack.indexes[HOST].pin(fetch.key)
                fetch.state = FetchState.STAGED
                return plan.dst
            fetch.state = FetchState.FAILED
            self.shared.stats.shared_failures += 1
            self.shared.failures.note(f"shared read {result.status.value}", result.detail)
        others.drop(foreign)
        return None

    def _complete_remote(self, fetch: Fetch, result: IOResult) -> Location | None:
        """A read from the remote store: the chunk is now in this store's host memory
        (under ``write_through`` also written to disk), or it was not there after all."""
        plan, remote = fetch.plan, self.shared.remote
        assert plan is not None and remote is not None
        with self.shared.lock:
            remote.read_over(fetch.key, result)
            if not result.ok:
                self._staged(plan, False)
                fetch.state = FetchState.FAILED
                return None
        fetch.state = FetchState.STAGED  # pinned by the finish: released by release()
        try:
            self.runner.finish(fetch.key, plan.dst, True, pin=True)
        finally:
            with self.shared.lock:  # after the commit: whoever waited finds it in host memory
                self.stagings.end(plan)
        return plan.dst

    def drop_unused(self, fetch: Fetch) -> None:
        """A fetch past the end of the prefix: keep what already arrived, else let go of the
        read without waiting (its slot is freed when it ends; the chunk stays cached). A read
        into the caller's tensor is waited for, as long as ``complete`` would: the caller
        gets its tensor back once nothing can write into it any more."""
        if fetch.direct is None and fetch.state is FetchState.READING and fetch.read is not None \
                and not fetch.read.done():
            self._give_up(fetch, timed_out=False)
        else:
            self.complete(fetch)

    def _give_up(self, fetch: Fetch, timed_out: bool) -> None:
        """Stop waiting for a fetch's read. Its host slot stays reserved until the read
        ends, since the read may still write into it, and its disk slot held: a chunk
        written into that slot meanwhile would be found by the late read as another chunk,
        and blanked as corrupt. A read past its deadline (a hung disk) also drops the chunk,
        counts, and counts against its path's health."""
        read, plan, fetch.state = fetch.read, fetch.plan, FetchState.GIVEN_UP
        assert read is not None, "only a disk read in flight is given up"
        held = None
        if fetch.foreign is None and fetch.loc.tier is DISK:
            with self.shared.lock:
                if self.shared.stack.indexes[DISK].hold(fetch.key):
                    held = fetch.loc
        if fetch.direct is not None:
            target, index = fetch.direct
            target.detach(index)  # the late read lands in memory the caller no longer sees
        if timed_out and (fetch.foreign is not None or fetch.loc.tier is REMOTE):
            where = "shared" if fetch.foreign is not None else "remote"  # not this store's disk
            with self.shared.lock:
                self.shared.stats.load_timeouts += 1
                self.shared.failures.note(f"{where} read timed_out", "no answer after "
                                          f"{self.shared.config.load_timeout:g} s (load_timeout)")
        elif timed_out:
            with self.shared.lock:
                self.shared.stack.discard(fetch.key)
            self.shared.timed_out(fetch.loc.slot, "disk read timed_out", "no answer from disk "
                                  f"after {self.shared.config.load_timeout:g} s (load_timeout)")

        if plan is not None or held is not None:  # its slots are free once the read ends
            staged, key = plan, fetch.key

            def ended(_: Future) -> None:
                with self.shared.lock:
                    if held is not None:
                        self.shared.stack.unpin(key, held)
                    if staged is not None:
                        self._staged(staged, False)

            read.add_done_callback(ended)

    def release(self, *fetches: Fetch) -> None:
        with self.shared.lock:  # once for a run of fetches
            for fetch in fetches:
                self._unpin(fetch.key, fetch.loc)
                if fetch.state is FetchState.STAGED and fetch.plan is not None:
                    self.shared.stack.unpin(fetch.key, fetch.plan.dst)

    def unpin(self, held: list[tuple[ChunkKey, Location]]) -> None:
        with self.shared.lock:
            for key, loc in held:
                self.shared.stack.unpin(key, loc)
