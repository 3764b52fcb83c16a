"""Running a store's plans: demotions down the tiers, the chunk's own copy, write-through
and write-back to disk, promotions. One ``PlanRunner`` per ``KVStore``."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

import torch

from kvtier.config import WritePolicy
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.store_shared import DISK, HOST, StoreShared
from kvtier.tier_stack import Location, Move, StorePlan
from kvtier.transfers import as_raw


class PlanRunner:
    """Carries out ``StorePlan``s of the tier stack.

    Contract: ``run(plan, fill)`` runs the plan's demotions, then ``fill(dst)``, and
    finishes every reservation it holds, whatever fails; a demotion to disk not over by
    ``load_timeout`` (a hung drive) fails the plan, its slots staying reserved until that
    write ends. A chunk that reaches host memory is written to disk in the background under
    ``write_through`` (dropped, and counted, when the path's queue is full).
    """

    def __init__(self, shared: StoreShared) -> None:
        self.shared = shared

    def copy_in(self, chunk: torch.Tensor, dst: Location) -> None:
        self.shared.transfers.view(dst).copy_(as_raw(chunk))

    def run(self, plan: StorePlan, fill: Callable[[Location], object]) -> bool:
        """Run the plan's demotions, then ``fill(dst)``; finish every reservation."""
        if not self.demote(plan):
            return False
        ok = False
        try:
            fill(plan.dst)
            self.shared.sync()
            ok = True
        finally:
            self.finish(plan.key, plan.dst, ok)
        return ok

    def demote(self, plan: StorePlan) -> bool:
        """Run the plan's demotions, deepest first. False when a write to disk is not over
        by ``load_timeout`` (a hung drive): the later moves and the plan itself then fail,
        and their slots stay reserved until that write ends, as it still reads from them."""
        for i, move in enumerate(plan.demotions):
            try:
                hung = self._move(move)
            except BaseException:
                self._fail_reservations(plan, i + 1)
                raise
            if hung is not None:
                hung.add_done_callback(partial(self._fail_reservations, plan, i + 1))
                return False
        return True

    def _fail_reservations(self, plan: StorePlan, first_move: int, _: Future | None = None) -> None:
        with self.shared.lock:
            for move in plan.demotions[first_move:]:
                self.shared.stack.finish(move.key, move.dst, False)
            self.shared.stack.finish(plan.key, plan.dst, False)

    def _move(self, move: Move) -> Future | None:
        """Copy one chunk down a tier and finish its reservation. A write to disk runs on the
        I/O engine; one not over by ``load_timeout`` is left running and returned: it is
        counted and logged, and its reservation is finished when it ends."""
        if move.dst.tier is not DISK:
            result = IOResult(IOStatus.IO_ERROR, detail="move did not run")
            try:
                result = self.shared.transfers.copy(move.key, move.src, move.dst)
                self.shared.sync()
            finally:
                self.finish(move.key, move.dst, result.ok)
            return None
        try:
            write = self.shared.lane.submit(self.shared.lane.move_queue_of(move.dst.slot),
                                      partial(self.shared.transfers.copy, move.key, move.src, move.dst))
        except BaseException:  # the engine is closed: nothing runs
            self.finish(move.key, move.dst, False)
            raise
        try:
            result = write.result(timeout=self.shared.config.load_timeout)
        except TimeoutError:
            return self._left_running(move, write)
        except Exception as exc:  # the copy raised: a failed write, never a crash
            result = IOResult(IOStatus.IO_ERROR, detail=repr(exc))
        self._moved(move, result)
        return None

    def _left_running(self, move: Move, write: Future) -> Future:
        """A write-back past ``load_timeout``: counted, logged once, and finished when it ends."""
        self.shared.timed_out(move.dst.slot, "disk write-back timed_out", f"a chunk moving to disk got "
                        f"no answer after {self.shared.config.load_timeout:g} s (load_timeout); the put "
                        "or get that needed its host slot went on without it")
        write.add_done_callback(lambda f: self._moved(move, _result_of(f)))
        return write

    def _moved(self, move: Move, result: IOResult) -> None:
        self.finish(move.key, move.dst, result.ok)
        with self.shared.lock:
            self.shared.account_write(result)

    def finish(self, key: ChunkKey, dst: Location, ok: bool) -> None:
        with self.shared.lock:
            self.shared.stack.finish(key, dst, ok)
            if ok and dst.tier is HOST:
                self._write_through(key, dst.slot)

    def _write_through(self, key: ChunkKey, host_slot: int) -> None:
        """Start a background disk write of a chunk that just reached host (lock held);
        dropped when the disk queue is full (``flush`` writes it later)."""
        if self.shared.config.write_policy is not WritePolicy.WRITE_THROUGH:
            return
        if not self.shared.stack.indexes[DISK].has_entry(key):
            self.start_disk_write(key, host_slot, may_drop=True)

    def start_disk_write(self, key: ChunkKey, host_slot: int, may_drop: bool = False) -> Future | None:
        """Reserve a disk slot for a host chunk and queue its write (lock held); None when
        there is no room, or the queue is full and ``may_drop``."""
        plan = self.shared.stack.plan_store(key, DISK)
        if plan is None:
            return None
        queue = self.shared.lane.queue_of(plan.dst.slot)
        if may_drop and self.shared.lane.pending(queue) >= self.shared.max_pending:
            self.shared.stack.finish(key, plan.dst, False)
            self.shared.stats.dropped_writes += 1
            self.shared.failures.note("write-through dropped", "the disk write queue is full; "
                                "chunks stay in host memory until flush() or eviction "
                                "writes them (counted in dropped_writes)")
            return None
        src = Location(HOST, host_slot)
        self.shared.stack.indexes[HOST].pin(key)
        return self.shared.lane.submit(queue, lambda: self._background_write(key, src, plan.dst))

    def _background_write(self, key: ChunkKey, src: Location, dst: Location) -> bool:
        result = IOResult(IOStatus.IO_ERROR, detail="write did not run")
        try:
            result = self.shared.transfers.copy(key, src, dst)
        finally:
            with self.shared.lock:
                self.shared.stack.finish(key, dst, result.ok)
                self.shared.stack.unpin(key, src)
                self.shared.account_write(result)
        return result.ok

    def promote(self, key: ChunkKey, source: Location) -> None:
        with self.shared.lock:
            plan = self.shared.stack.plan_store(key, self.shared.top)
        if plan is not None and self.run(plan, partial(self.copy_in, self.shared.transfers.view(source))):
            self.shared.count("chunks_promoted")


def _result_of(write: Future) -> IOResult:
    try:
        return write.result()
    except BaseException as exc:  # cancelled at close, or an unexpected error
        return IOResult(IOStatus.IO_ERROR, detail=repr(exc))
