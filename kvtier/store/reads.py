"""Fetching the chunks of a ``get``: pinned where they are hottest, disk chunks read in
parallel and verified (into host slots, or straight into the caller's tensor), each read
bounded by ``load_timeout``."""

from __future__ import annotations

from collections.abc import Collection
from concurrent.futures import Future

import numpy as np

from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.store.books import Held
from kvtier.store.direct import DirectTarget
from kvtier.store.fetch import Fetch, FetchState, Source, fingerprint
from kvtier.store.read_jobs import ReadJobs
from kvtier.store.skip import Skip
from kvtier.store.staging import Stagings
from kvtier.store.state import DISK, HOST, REMOTE, SHARED, StoreState
from kvtier.store.writes import PlanRunner
from kvtier.tiers.prefix import IN_REMOTE, Ours, find
from kvtier.tiers.stack import Location, StorePlan
from kvtier.units import time_left


class Fetcher:
    """Starts and completes the fetches of a ``get``.

    Contract: ``begin(key, direct)`` pins the chunk where it is hottest and, from disk,
    reserves a host slot for its read (``Skip.NO_ROOM`` when no host slot is free,
    ``Skip.BUSY`` when another ``get`` is reading it into one: ``wait_staged(key)``, then
    begin again; ``Skip.END`` when the prefix ends there), or with a ``direct`` target
    reads it straight there on the chunk's first read from disk (its second one goes
    through a host slot, which promotes it); ``start(fetches)`` starts the reads of fetches
    begun, grouped; ``complete(fetch)`` says where the chunk can be copied from (for a
    direct read: its disk slot, the bytes being in place), or None when its read failed (the
    chunk is dropped) or was not over in time (a direct read's pages are then detached from
    the caller); ``release(*fetches)`` unpins what ``begin`` and ``complete`` pinned."""

    def __init__(self, state: StoreState, runner: PlanRunner) -> None:
        self.state, self.runner, self.books = state, runner, state.books
        # per disk slot, the fingerprint of the chunk last read from it straight into a
        # caller's tensor (lock held): its next read promotes it
        self._read_direct = np.zeros(state.lane.num_slots, dtype=np.uint64)
        self.stagings = Stagings(state.books)  # host slots reserved for reads, until finished
        self.jobs = ReadJobs(state)

    def hold_disk_chunks(self, keys: list[ChunkKey]) -> list[tuple[ChunkKey, Location]]:
        """Pin the disk copies of the cached prefix of ``keys`` for a whole ``get`` (of the
        chunks in host memory too): making room in host memory for one read demotes host
        chunks to disk, which must not evict a later chunk of the same prefix from both."""
        if not self.state.lane.num_slots:
            return []  # no disk tier
        return self.books.pin_prefix(keys, DISK)

    def begin(self, key: ChunkKey, direct: tuple[DirectTarget, int] | None = None,
              remote: bool = False, spare: Collection[ChunkKey] = (),
              held: list[tuple[ChunkKey, Location]] | None = None,
              careful: bool = True) -> Fetch | Skip:
        """Pin ``key`` where it is hottest; from disk, another writer's segment or the remote
        store (``remote``: it said it holds the chunk), choose where its read lands. A chunk
        of ``spare`` (the get's later ones) that making room moves to disk is pinned there,
        in ``held`` (the get's disk pins). ``END`` when the key is not cached or its host
        slot's previous chunk could not be written back in time (a hung drive), ``NO_ROOM``
        when no host slot is free, ``NO_ROOM_BELOW`` (``careful``) when one could be made
        only by dropping one of ``spare``, ``BUSY`` when another get is reading it in.
        """
        with self.books.held() as b:
            source = self._pin_where(b, key, remote)
            if source is None:
                return Skip.END
            if isinstance(source, Ours) and source.tier is not DISK:
                return Fetch(key, source)
            if direct is not None and isinstance(source, Ours) \
                    and self._read_direct[source.loc.slot] != fingerprint(key):
                return Fetch(key, source, FetchState.READING, direct=direct)
            below = careful and b.stack.costs_spare(key, HOST, spare)  # victim outside it
            plan = None if below else b.stack.plan_store(key, HOST, spare)
            if plan is None:
                _unpin(b, key, source)
                if self.stagings.busy(key):
                    return Skip.BUSY
                return Skip.NO_ROOM_BELOW if below else Skip.NO_ROOM
            self.stagings.begin(plan)
        try:
            demoted = self.runner.demote(plan)
        except BaseException:  # the engine closed meanwhile: its reservations are finished
            self._abandon(key, source, plan)
            raise
        if not demoted:  # a hung drive: end the prefix here, the chunk stays cached
            self._abandon(key, source, plan)  # whoever waits for it: no read is coming
            return Skip.END
        if held is not None and plan.demotions:
            self._hold_moved(plan, spare, held)
        return Fetch(key, source, FetchState.READING, None, plan)

    def _hold_moved(self, plan: StorePlan, spare: Collection[ChunkKey],
                    held: list[tuple[ChunkKey, Location]]) -> None:
        """Pin on disk each chunk of ``spare`` the plan's demotions moved there."""
        moved = [move.key for move in plan.demotions if move.dst.tier is DISK and move.key in spare]
        with self.books.held() as b:
            disk = b.stack.indexes[DISK]
            held += [(key, Location(DISK, slot)) for key in moved
                     if (slot := disk.pin(key)) is not None]

    def _pin_where(self, b: Held, key: ChunkKey, remote: bool) -> Source | None:
        """Where ``key`` is hottest, pinned there when it is this store's (lock held: ``b``);
        the remote store when ``remote`` (it said it holds the chunk); None: nowhere."""
        others = self.state.others
        source = find(key, b.stack.locate, others.find if others else None)
        if isinstance(source, Ours):
            b.stack.indexes[source.tier].pin(key)
        return IN_REMOTE if source is None and remote else source

    def _abandon(self, key: ChunkKey, source: Source, plan: StorePlan) -> None:
        """Let go of a fetch ``begin`` pinned, its staging ended (its slot is finished)."""
        with self.books.held() as b:
            _unpin(b, key, source)
            self.stagings.end(plan)

    def wait_staged(self, key: ChunkKey, timeout: float | None) -> bool:
        """Wait (lock not held) until no ``get`` is reading ``key`` into a host slot; False
        when one still is after ``timeout`` seconds."""
        return self.stagings.wait(key, timeout)

    def _staged(self, b: Held, plan: StorePlan, ok: bool) -> bool:
        """Finish the host slot reserved for a chunk's read (lock held: ``b``): True when
        committed (not when the chunk was found wrong meanwhile: ``StoreState.unwanted``)."""
        ok = not self.state.was_unwanted(plan.key, plan.dst) and ok
        committed = b.stack.finish(plan.key, plan.dst, ok)
        self.stagings.end(plan)
        return committed

    def start(self, fetches: list[Fetch]) -> None:
        """Start the reads of fetches ``begin`` reserved (``ReadJobs.start``)."""
        self.jobs.start(fetches)

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
        read = fetch.read
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
        if fetch.other is not None:
            return self._complete_other(fetch, result)
        if fetch.tier is REMOTE:
            return self._complete_remote(fetch, result)
        return self._complete_disk(fetch, result)

    def _complete_disk(self, fetch: Fetch, result: IOResult) -> Location | None:
        """A read from this store's disk: the chunk is now in a host slot (promoted) or in
        the caller's tensor, or its disk copy is dropped."""
        plan = fetch.plan
        with self.books.held() as b:
            committed = plan is None or self._staged(b, plan, result.ok)
            if result.ok and not committed:  # found wrong while it was read: a miss
                fetch.state = FetchState.FAILED
                return None
            if result.ok:
                b.stats.disk_reads += 1
                b.stats.disk_read_bytes += result.nbytes
                if plan is None:
                    self._read_direct[fetch.loc.slot] = fingerprint(fetch.key)
                    fetch.state = FetchState.LANDED
                    return fetch.loc
                b.stack.indexes[HOST].pin(fetch.key)
                b.stats.chunks_promoted += 1  # disk to host: it stays there
                fetch.state = FetchState.STAGED
                return plan.dst
            fetch.state = FetchState.FAILED
            b.stack.discard(fetch.key)
            b.account_failure(result, "read")
        return None

    def _complete_other(self, fetch: Fetch, result: IOResult) -> Location | None:
        """A read from another writer's segment: the chunk is now in this store's host
        memory, or a miss (that copy forgotten or not: ``OtherWriters.read_over``)."""
        plan, others, refs = fetch.plan, self.state.others, fetch.other
        assert plan is not None and others is not None and refs is not None
        others.read_over(refs, result)
        with self.books.held() as b:
            if not self._staged(b, plan, result.ok) and result.ok:
                fetch.state = FetchState.FAILED  # found wrong while it was read: a miss
                return None
            if result.ok:
                b.stats.shared_reads += 1
                b.stats.shared_read_bytes += result.nbytes
                b.stack.indexes[HOST].pin(fetch.key)
                fetch.state = FetchState.STAGED
                return plan.dst
            fetch.state = FetchState.FAILED
            b.stats.shared_failures += 1
            b.failures.note(f"shared read {result.status.value}", result.detail)
        return None

    def _complete_remote(self, fetch: Fetch, result: IOResult) -> Location | None:
        """A read from the remote store: the chunk is now in this store's host memory
        (under ``write_through`` also written to disk), or it was not there after all."""
        plan, remote = fetch.plan, self.state.remote
        assert plan is not None and remote is not None
        with self.books.held() as b:
            remote.read_over(b, fetch.key, result)
            if not result.ok:
                self._staged(b, plan, False)
                fetch.state = FetchState.FAILED
                return None
        fetch.state = FetchState.STAGED  # pinned by the finish: released by release()
        try:
            committed = self.runner.finish(fetch.key, plan.dst, True, pin=True)
        finally:
            with self.books.held():  # after the commit: whoever waited finds it in host memory
                self.stagings.end(plan)
        if not committed:  # found wrong while it was read (``forget``): a miss
            fetch.state = FetchState.FAILED
            return None
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
        held = fetch.loc if fetch.tier is DISK and self.books.hold(DISK, fetch.key) else None
        if fetch.direct is not None:
            target, index = fetch.direct
            target.detach(index)  # the late read lands in memory the caller no longer sees
        if timed_out and fetch.tier in (SHARED, REMOTE):
            where = "shared" if fetch.other is not None else "remote"  # not this store's disk
            self.books.failed("load_timeouts", f"{where} read timed_out", "no answer after "
                              f"{self.state.config.load_timeout:g} s (load_timeout)")
            if fetch.other is not None and self.state.others is not None:  # no proof: three
                self.state.others.read_failed(fetch.other, False)  # in a row forget the copy
        elif timed_out:
            self.books.discard(fetch.key)
            self.books.timed_out(fetch.loc.slot, "disk read timed_out", "no answer from disk "
                                  f"after {self.state.config.load_timeout:g} s (load_timeout)")
        if plan is not None or held is not None:  # its slots are free once the read ends
            staged, key = plan, fetch.key

            def ended(_: Future) -> None:
                with self.books.held() as b:
                    if held is not None:
                        b.stack.unpin(key, held)
                    if staged is not None:
                        self._staged(b, staged, False)

            read.add_done_callback(ended)

    def release(self, *fetches: Fetch) -> None:
        pins = []  # given back under one hold of the lock, for a run of fetches
        for fetch in fetches:
            if isinstance(fetch.source, Ours):
                pins.append((fetch.key, fetch.source.loc))
            if fetch.state is FetchState.STAGED and fetch.plan is not None:
                pins.append((fetch.key, fetch.plan.dst))
        self.books.unpin(pins)

    def unpin(self, held: list[tuple[ChunkKey, Location]]) -> None:
        self.books.unpin(held)


def _unpin(b: Held, key: ChunkKey, source: Source) -> None:
    """Give back the pin ``begin`` took (lock held: ``b``): another writer's chunk or the
    remote store's has none."""
    if isinstance(source, Ours):
        b.stack.unpin(key, source.loc)
