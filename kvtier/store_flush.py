"""``KVStore.flush``: every host chunk not on disk yet is written, a batch at a time."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kvtier.keys import ChunkKey
from kvtier.store_shared import DISK, HOST, StoreShared, time_left
from kvtier.store_writes import PlanRunner, StartedWrite


@dataclass(frozen=True)
class FlushResult:
    """What ``flush`` did: chunks it wrote, host chunks still not on disk when it returned
    (without a disk tier or remote store: every chunk held, as none outlives the process),
    and whether it stopped at its timeout. True when every host chunk is on disk."""

    written: int
    not_written: int
    timed_out: bool = False

    def __bool__(self) -> bool:
        return self.not_written == 0 and not self.timed_out


class Flusher:
    """Writes the host chunks that have no disk copy, ``batch`` at a time (so that puts
    meanwhile find host slots), each tried once; writes already in flight are waited for
    first, as they may fail. A batch is queued whole before its jobs start, so it goes to
    the disk in groups of neighbouring slots (``PlanRunner``). The disk may evict a chunk
    that is also in host memory to make room: such a chunk is written again in a later
    round. Without a disk tier there is nothing to write: with a remote store, that store's
    flush says the rest (``KVStore.flush``); without one, every chunk held is unwritten."""

    def __init__(self, shared: StoreShared, runner: PlanRunner) -> None:
        self._shared, self._runner = shared, runner

    def flush(self, timeout: float | None) -> FlushResult:
        lane = self._shared.lane
        if not lane.num_slots:  # no disk tier: nothing to write to
            if self._shared.remote is not None:
                return FlushResult(0, 0)
            with self._shared.lock:
                held = sum(len(index) for index in self._shared.stack.indexes.values())
            return FlushResult(0, held)
        deadline = None if timeout is None else time.monotonic() + timeout
        batch = self._shared.max_pending * len(lane.queues)
        drained = lane.drain(time_left(deadline))
        tried: set[ChunkKey] = set()
        written = 0
        while drained:
            # again after each round: its writes may have evicted the disk copy of a host
            # chunk that had one; each chunk is tried once
            with self._shared.lock:
                todo = deque(c for c in self._host_only() if c[0] not in tried)
            if not todo:
                break
            tried.update(key for key, _ in todo)
            while drained and todo:
                with self._shared.lock:
                    started = self._start_writes(todo, batch)
                self._runner.start_all(started)
                drained = lane.drain(time_left(deadline))
                written += sum(1 for w in started if w.future.done() and w.future.result().ok)
        with self._shared.lock:
            left = len(self._host_only())
        return FlushResult(written, left, timed_out=not drained)

    def _host_only(self) -> list[tuple[ChunkKey, int]]:
        """(key, host slot) of host chunks with no disk copy and none being written (lock
        held). A chunk another writer of a shared directory holds has one: it is not
        written to this store's segment again."""
        indexes = self._shared.stack.indexes
        host, disk, others = indexes[HOST], indexes[DISK], self._shared.others
        found, visible = [], host.keys()
        for key in visible:
            slot = host.slot_of(key)
            if slot is not None and not disk.has_entry(key) \
                    and (others is None or others.find(key) is None):
                found.append((key, slot))
        return found

    def _start_writes(self, todo: deque[tuple[ChunkKey, int]], batch: int) -> list[StartedWrite]:
        """Queue the disk writes of up to ``batch`` chunks of ``todo`` still in host memory
        and not on disk (lock held; start them once it is released): they go to the disk in
        groups of neighbouring slots. A chunk the disk has no room for is skipped."""
        indexes = self._shared.stack.indexes
        host, disk = indexes[HOST], indexes[DISK]
        started: list[StartedWrite] = []
        while todo and len(started) < batch:
            key, _ = todo.popleft()
            slot = host.slot_of(key)  # it may have moved or gone since the flush began
            if slot is None or disk.has_entry(key):
                continue
            write = self._runner.start_disk_write(key, slot)
            if write is not None:
                started.append(write)
        return started
