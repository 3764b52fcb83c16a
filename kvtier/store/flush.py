"""``KVStore.flush``: every chunk held in memory and not on disk yet is written (host chunks a
batch at a time, device pool chunks one by one), then each disk path is synced."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import wait
from dataclasses import dataclass, replace
from functools import partial

from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.store.books import Held
from kvtier.store.disk_writes import StartedWrite
from kvtier.store.remote import RemoteFlush
from kvtier.store.state import DISK, GPU, HOST, StoreState
from kvtier.store.sync_watch import SyncedIndex, SyncWatch
from kvtier.store.writes import PlanRunner, result_of
from kvtier.tiers.stack import Location
from kvtier.units import time_left


@dataclass(frozen=True)
class FlushResult:
    """What ``flush`` did: chunks it wrote, chunks held in memory still not on disk when it
    returned, or on disk only by a write over after its path's sync began, which no sync
    covered (without a disk tier or remote store: every chunk held, as none outlives the
    process), chunks a remote store was asked to write and does not hold
    (``remote_not_written``: refused, failed or lost; ``StoreRemote.flush``), and whether it
    stopped at its timeout; ``not_synced``: disk paths whose files could not be made durable
    (``DiskLane.sync`` failed: an I/O error, which takes the path out of service, or a
    filesystem that syncs no file). True when every chunk held in memory is on disk, synced,
    and every chunk sent to the remote store is there."""

    written: int
    not_written: int
    timed_out: bool = False
    remote_not_written: int = 0
    not_synced: int = 0

    def __bool__(self) -> bool:
        return (self.not_written == 0 and self.remote_not_written == 0 and not self.timed_out
                and self.not_synced == 0)

    def with_remote(self, remote: RemoteFlush) -> FlushResult:
        """This result with a remote store's flush."""
        return replace(self, remote_not_written=remote.not_written,
                       timed_out=self.timed_out or remote.timed_out)


class Flusher:
    """Writes the host chunks that have no disk copy, ``batch`` at a time (so that puts
    meanwhile find host slots), each tried once; writes already in flight are waited for
    first, as they may fail. A batch is queued whole before its jobs start, so it goes to
    the disk in groups of neighbouring slots (``PlanRunner``). The disk may evict a chunk
    that is also in host memory to make room: such a chunk is written again in a later
    round. A device pool chunk with no copy below it is written from a copy of its own in
    host memory (not a host slot: the host tier's chunks stay where they are).
    Without a disk tier there is nothing to write: with a remote store, that store's flush
    says the rest (``KVStore.flush``; device pool chunks with no host copy count as not
    written); without one, every chunk held is unwritten."""

    def __init__(self, state: StoreState, runner: PlanRunner, synced: SyncedIndex) -> None:
        self._state, self._runner, self._synced = state, runner, synced

    def flush(self, timeout: float | None) -> FlushResult:
        lane, books = self._state.lane, self._state.books
        if not lane.num_slots:  # no disk tier: nothing to write to
            with books.held() as b:
                if self._state.remote is not None:
                    return FlushResult(0, len(self._device_only(b)))
                return FlushResult(0, sum(len(index) for index in b.stack.indexes.values()))
        deadline = None if timeout is None else time.monotonic() + timeout
        in_service = set(range(len(lane.queues))) - set(lane.down_paths)
        batch = self._state.max_pending * len(lane.queues)
        written = self._write_device_chunks(deadline)
        drained = lane.drain(time_left(deadline))
        tried: set[ChunkKey] = set()
        while drained:
            # again after each round: its writes may have evicted the disk copy of a host
            # chunk that had one; each chunk is tried once
            with books.held() as b:
                todo = deque(c for c in self._host_only(b) if c[0] not in tried)
            if not todo:
                break
            tried.update(key for key, _ in todo)
            while drained and todo:
                with books.held() as b:  # once for a batch
                    started = self._start_writes(b, todo, batch)
                self._runner.disk_writes.start_all(started)
                drained = lane.drain(time_left(deadline))
                written += sum(1 for w in started if w.future.done() and w.future.result().ok)
        if not drained:  # a hung drive: a sync would hang as well
            with books.held() as b:
                return FlushResult(written, self._not_on_disk(b, set()), timed_out=True)
        with books.held():
            watch = self._synced.watch()
        try:
            not_synced, synced = self._sync(deadline, in_service, watch)
            with books.held() as b:  # after the syncs: one may have taken its path down
                return FlushResult(written, self._not_on_disk(b, watch.late),
                                   timed_out=not synced, not_synced=not_synced)
        finally:
            with books.held():
                self._synced.unwatch(watch)

    def _sync(self, deadline: float | None, in_service: set[int],
              watch: SyncWatch) -> tuple[int, bool]:
        """Sync every disk path on its own queue, its writes over (``DiskLane.sync``), each
        sync's beginning told to ``watch`` (``SyncedIndex``: a write over after it is not
        covered): (paths of ``in_service``, those in service when the flush began, whose
        sync failed or that went out of service meanwhile, each failure counted and logged
        once per kind, a path taken out retired from the disk index at once, so that the
        count of chunks not on disk follows; whether every sync ended by ``deadline``)."""
        lane = self._state.lane
        jobs = {index: lane.submit(queue, partial(self._sync_path, watch, queue, index))
                for index, queue in enumerate(lane.queues)}
        done, pending = wait(jobs.values(), time_left(deadline))
        ended = {index: result_of(job) for index, job in jobs.items() if job in done}
        failed = {index: result for index, result in ended.items() if not result.ok}
        with self._state.books.held() as b:
            for result in failed.values():
                b.account_failure(result, "sync")
        return sum(index in in_service or result.status is not IOStatus.PATH_DOWN
                   for index, result in failed.items()), not pending

    def _sync_path(self, watch: SyncWatch, queue: str, index: int) -> IOResult:
        """Blocking (on ``queue``, path ``index``'s): ``DiskLane.sync``, once ``watch`` is
        told it begins."""
        with self._state.books.held():
            watch.begin(queue)
        return self._state.lane.sync(index)

    def _not_on_disk(self, b: Held, late: set[ChunkKey]) -> int:
        """Chunks held in memory with no disk copy a sync covered (one whose write is not
        over counts: it is not on disk yet; one of ``late``, written after its path's sync
        began, is not durable yet), nor one in another writer's segment (lock held: ``b``)."""
        indexes, elsewhere = b.stack.indexes, self._state.held_elsewhere
        held = set().union(*(indexes[tier].keys() for tier in (GPU, HOST) if tier in indexes))
        return sum(1 for key in held if (indexes[DISK].slot_of(key) is None or key in late)
                   and not elsewhere(key))

    def _device_only(self, b: Held) -> list[ChunkKey]:
        """Device pool chunks with no host or disk copy (lock held: ``b``), none in another
        writer's segment either."""
        indexes = b.stack.indexes
        if GPU not in indexes:
            return []
        below, held = [indexes[tier] for tier in (HOST, DISK)], indexes[GPU].keys()
        return [key for key in held if not any(index.has_entry(key) for index in below)
                and not self._state.held_elsewhere(key)]

    def _write_device_chunks(self, deadline: float | None) -> int:
        """Write each device pool chunk with no copy below it to disk, one at a time until
        ``deadline``, through a copy in host memory of its own (host slots and their chunks
        are left alone); return how many were written."""
        with self._state.books.held() as b:
            keys = self._device_only(b)
        written = 0
        for key in keys:
            if deadline is not None and time.monotonic() >= deadline:
                break
            written += self._write_device_chunk(key, deadline)
        return written

    def _write_device_chunk(self, key: ChunkKey, deadline: float | None) -> bool:
        books = self._state.books
        with books.held() as b:
            indexes = b.stack.indexes
            if indexes[HOST].has_entry(key) or indexes[DISK].has_entry(key):
                return False
            slot = indexes[GPU].pin(key)
            if slot is None:
                return False  # evicted meanwhile
            plan = b.stack.plan_store(key, DISK)
            if plan is None:  # no room: counted as not written
                indexes[GPU].unpin(key)
                return False
        pinned = Location(GPU, slot)
        try:
            staged = self._state.transfers.staged(pinned)
        except BaseException:
            books.abort([(key, plan.dst)])
            raise
        finally:
            books.unpin([(key, pinned)])
        return bool(self._runner.write_staged(key, staged, plan.dst, deadline))

    def _host_only(self, b: Held) -> list[tuple[ChunkKey, int]]:
        """(key, host slot) of host chunks with no disk copy and none being written (lock
        held: ``b``). A chunk another writer of a shared directory holds has one: it is not
        written to this store's segment again."""
        indexes = b.stack.indexes
        host, disk = indexes[HOST], indexes[DISK]
        found, visible = [], host.keys()
        for key in visible:
            slot = host.slot_of(key)
            if slot is not None and not disk.has_entry(key) and not self._state.held_elsewhere(key):
                found.append((key, slot))
        return found

    def _start_writes(self, b: Held, todo: deque[tuple[ChunkKey, int]],
                      batch: int) -> list[StartedWrite]:
        """Queue the disk writes of up to ``batch`` chunks of ``todo`` still in host memory
        and not on disk (lock held: ``b``; start them once it is released): they go to the
        disk in groups of neighbouring slots. A chunk the disk has no room for is skipped."""
        indexes = b.stack.indexes
        host, disk = indexes[HOST], indexes[DISK]
        started: list[StartedWrite] = []
        while todo and len(started) < batch:
            key, _ = todo.popleft()
            slot = host.slot_of(key)  # it may have moved or gone since the flush began
            if slot is None or disk.has_entry(key):
                continue
            write = self._runner.disk_writes.queue(b, key, slot)
            if write is not None:
                started.append(write)
        return started
