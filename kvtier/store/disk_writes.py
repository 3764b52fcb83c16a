"""A store's background disk writes (write-through and ``flush``) as group commits: at most
``WRITE_JOBS_PER_PATH`` jobs per path write at once, and the chunks queued meanwhile go
together in the next job, up to ``WRITE_GROUP_BYTES`` (``WriteGroups``). A path's queue is
full when ``max_pending`` chunks are queued or being written on it. Each chunk keeps its
host slot pinned until its write ends, has its disk reservation finished and its outcome
counted on its own, and its future is settled inside the job."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

from kvtier.config.settings import KVTierConfig, WritePolicy
from kvtier.io.batch_writes import WRITE_GROUP_BYTES, WriteGroup, WriteGroups
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.store.books import Held
from kvtier.store.state import DISK, HOST, StoreState
from kvtier.tiers.host import HostTier
from kvtier.tiers.stack import Location, Move

# background write jobs running at once per path (at most io_threads): each writes up to
# WRITE_GROUP_BYTES, and chunks queued meanwhile wait to go together in the next one
WRITE_JOBS_PER_PATH = 2


def write_queue_bound(cfg: KVTierConfig, host_slots: int, paths: int) -> int:
    """Background writes a path queues before write-through drops (``max_pending``): its
    share of half the host slots, a quarter with a remote store (whose own writes may hold
    up to half), and at least 4 per I/O thread. A bound in chunks alone dropped most writes
    of a burst of small chunks, each then written on its own when evicted."""
    share = 4 if cfg.remote_url else 2
    return max(4 * cfg.io_threads, host_slots // (share * max(1, paths)))


@dataclass(frozen=True)
class StartedWrite:
    """A queued disk write: its outcome (``future``), and the job to submit once the lock is
    released (``group``, when the write opened one)."""

    future: Future[IOResult]
    groups: WriteGroups[Move]
    group: WriteGroup[Move] | None


class DiskWrites:
    """The background disk writes of one store, a ``WriteGroups`` per disk path."""

    def __init__(self, state: StoreState) -> None:
        self.state = state
        lane, cfg = state.lane, state.config
        per_group = WRITE_GROUP_BYTES // max(1, state.transfers.chunk_bytes)
        jobs = min(cfg.io_threads, WRITE_JOBS_PER_PATH)
        self.groups = {queue: WriteGroups(partial(lane.submit, queue), self._write_group,
                                          self._settle_group, per_group, jobs, lambda: lane.closed)
                       for queue in lane.queues}
        self._counted: dict[str, float] = {}  # queue -> when a stalled write last counted

    def write_through(self, b: Held, key: ChunkKey, host_slot: int) -> StartedWrite | None:
        """Queue the background disk write of a chunk that just reached host (lock held:
        ``b``); dropped when its path's queue is full (``flush`` writes it later)."""
        if self.state.config.write_policy is not WritePolicy.WRITE_THROUGH:
            return None
        if b.stack.indexes[DISK].has_entry(key):
            return None
        return self.queue(b, key, host_slot, may_drop=True)

    def queue(self, b: Held, key: ChunkKey, host_slot: int,
              may_drop: bool = False) -> StartedWrite | None:
        """Reserve a disk slot for a host chunk and queue its write (lock held: ``b``; pass
        the result to ``start`` once the lock is released). None when there is no room, or
        the path's queue is full (``max_pending`` chunks queued or being written) and
        ``may_drop``. The host slot stays pinned until the write ends."""
        if may_drop and self._victim_on_full_path(b):  # dropped later, it was lost for it
            return self._dropped(b)
        plan = b.stack.plan_store(key, DISK)
        if plan is None:
            return None
        groups = self.groups[self.state.lane.queue_of(plan.dst.slot)]
        if may_drop and groups.pending >= self.state.max_pending:
            b.stack.finish(key, plan.dst, False)
            return self._dropped(b)
        b.stack.indexes[HOST].pin(key)
        future, group = groups.add(Move(key, Location(HOST, host_slot), plan.dst))
        return StartedWrite(future, groups, group)

    def _victim_on_full_path(self, b: Held) -> bool:
        """True when a disk slot reserved now would be a chunk's, evicted for it, on a path
        whose queue is full (a free slot costs nothing if the write is dropped after all)."""
        disk = b.stack.indexes[DISK]
        free, victim = disk.peek()
        slot = None if free or victim is None else disk.slot_of(victim)
        if slot is None:
            return False
        return self.groups[self.state.lane.queue_of(slot)].pending >= self.state.max_pending

    @staticmethod
    def _dropped(b: Held) -> None:
        b.stats.dropped_writes += 1
        b.failures.note("write-through dropped", "the disk write queue is full; chunks stay "
                        "in host memory until flush() or eviction writes them (counted in "
                        "dropped_writes)")

    def count_stalled(self, timeout: float | None) -> None:
        """Each path whose write job has been writing for ``timeout`` (``load_timeout``) or
        more, once per ``timeout`` while it stays so, counts that against its health, as a
        read given up on does (three take a drive that stopped answering out of service)."""
        if timeout is None:
            return
        now = time.monotonic()
        stalled = {queue: move for queue, groups in self.groups.items()
                   if (move := groups.stalled(timeout)) is not None}
        if not stalled:  # the common case: no store lock taken
            return
        due = []
        with self.state.books.held():  # every call of the store looks: each stall counts once
            for queue, move in stalled.items():
                if now - self._counted.get(queue, 0.0) >= timeout:
                    self._counted[queue] = now
                    due.append(move.dst.slot)
        for slot in due:
            self.state.books.timed_out(slot, "disk write stalled", "a write not over after "
                                       "load_timeout counts against its path", given_up=False)

    def fail_waiting(self, down: Iterable[int]) -> None:
        """The writes waiting for a job on paths ``down`` (out of service) fail now, their
        host slots unpinned, rather than wait for a job a hung drive holds."""
        for index in down:
            self.groups[self.state.lane.queues[index]].fail_waiting(
                IOResult(IOStatus.PATH_DOWN, detail="its disk path went out of service"))

    @property
    def writes_pending(self) -> int:
        """Chunks whose background disk writes are queued or running, over every path."""
        return sum(groups.pending for groups in self.groups.values())

    @property
    def writes_waiting(self) -> int:
        """Chunks whose background disk writes wait for a job, over every path."""
        return sum(groups.waiting for groups in self.groups.values())

    def start(self, write: StartedWrite) -> None:
        """Submit the job ``queue`` opened, if any (lock not held)."""
        if write.group is not None:
            write.groups.start(write.group)

    def start_all(self, writes: list[StartedWrite]) -> None:
        """``start`` each; once one is refused (the engine closed), the rest are let go of
        (settled as never written, their pins and reservations given back), then it raises."""
        for i, write in enumerate(writes):
            try:
                self.start(write)
            except BaseException:
                for rest in writes[i + 1:]:
                    if rest.group is not None:
                        rest.groups.abandon(rest.group)
                raise

    def _write_group(self, writes: list[Move]) -> list[IOResult]:
        """Write chunks of one path together: neighbouring slots go in one ``pwritev``. A
        chunk that failed (I/O error, no space) along with others is written once more on its
        own, so one bad sector, or the last free bytes, fail only the chunks they concern."""
        host = self.state.tiers[HOST]
        assert isinstance(host, HostTier), "disk writes come from host slots"
        items = [(w.dst.slot, w.key, host.slot_array(w.src.slot)) for w in writes]
        results = self.state.lane.write_many(items)
        if len(items) > 1:
            for i, result in enumerate(results):
                if result.status in (IOStatus.IO_ERROR, IOStatus.NO_SPACE):
                    results[i] = self.state.lane.write_many([items[i]])[0]
        return results

    def _settle_group(self, writes: Sequence[Move], results: Sequence[IOResult] | None) -> None:
        """Finish each write's disk reservation, unpin its host slot and count its outcome
        (a write that never ran, at close, is not counted)."""
        wrong: list[Move] = []  # found wrong while being written (``verify.forget``)
        with self.state.books.held() as b:  # once for the group
            for i, write in enumerate(writes):
                ok = results is not None and results[i].ok
                if ok and write.key in self.state.forgotten:
                    wrong.append(write)
                else:
                    self.state.forgotten.discard(write.key)
                    b.stack.finish(write.key, write.dst, ok)
                b.stack.unpin(write.key, write.src)
                if results is not None:
                    b.account_write(results[i])
        for write in wrong:  # blanked while still reserved: no restart finds it
            self.state.lane.invalidate(write.dst.slot, write.key)
        if wrong:
            with self.state.books.held() as b:
                for write in wrong:
                    self.state.forgotten.discard(write.key)
                    b.stack.finish(write.key, write.dst, False)
