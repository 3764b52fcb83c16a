"""Running a store's plans: demotions down the tiers, the chunk's own copy, write-through
and write-back to disk, promotions. One ``PlanRunner`` per ``KVStore``."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from functools import partial

import numpy as np

from kvtier.config.settings import WritePolicy
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.store.chunk_runs import Run, copy_run
from kvtier.store.disk_writes import DiskWrites
from kvtier.store.state import DISK, HOST, StoreState
from kvtier.tiers.stack import Location, Move, StorePlan
from kvtier.units import time_left


class PlanRunner:
    """Carries out ``StorePlan``s of the tier stack.

    Contract: ``run(plan, fill)`` runs the plan's demotions, then ``fill(dst)``, and
    finishes every reservation it holds, whatever fails; a demotion to disk not over by
    ``load_timeout`` (a hung drive) fails the plan, its slots staying reserved until that
    write ends. A chunk that reaches host memory is written to disk in the background under
    ``write_through`` (dropped, and counted, when the path's queue is full), and offered to
    the remote tier (``StoreRemote.reached_host``).

    Background writes to disk are ``DiskWrites``' (``disk_writes``).
    """

    def __init__(self, state: StoreState) -> None:
        self.state = state
        self.disk_writes = DiskWrites(state)
        self._behind = 0  # device pool victims being written to disk from copies (lock held)

    def copy_in(self, chunk: Run, dst: Location) -> None:
        """Copy ``chunk`` (a run of one) into its slot."""
        self.copy(self.state.transfers.run_of(dst, 1), chunk)

    def fill_run(self, plans: Sequence[StorePlan], chunks: Run) -> None:
        """Copy ``chunks`` (a run of ``len(plans)``: ``chunk_runs``) into the plans' slots
        with one copy, and finish every reservation. The slots follow one another in one
        memory tier from ``plans[0].dst``; the plans' demotions are done."""
        ok = False
        try:
            self.copy(self.state.transfers.run_of(plans[0].dst, len(plans)), chunks)
            self.state.sync()
            ok = True
        finally:
            refused: RuntimeError | None = None
            for plan in plans:  # every one, even past a write the engine refused (closed)
                try:
                    self.finish(plan.key, plan.dst, ok)
                except RuntimeError as exc:
                    refused = refused or exc
            if refused is not None:
                raise refused

    def copy(self, target: Run, source: Run) -> None:
        """Copy run ``source`` into ``target``. With a disk or remote tier, a copy in CPU
        memory runs on this thread alone: torch's copy hands parts to its worker threads,
        which then wait spinning for more and take the cores the I/O needs."""
        copy_run(target, source, threads=not (self.disk_writes.groups or self.state.remote is not None))

    def run(self, plan: StorePlan, fill: Callable[[Location], object]) -> bool:
        """Run the plan's demotions, then ``fill(dst)``; finish every reservation."""
        if not self.demote(plan):
            return False
        ok = False
        try:
            fill(plan.dst)
            self.state.sync()
            ok = True
        finally:
            self.finish(plan.key, plan.dst, ok)
        return ok

    def demote(self, plan: StorePlan) -> bool:
        """Run the plan's demotions, deepest first. False when a write to disk is not over
        by ``load_timeout`` (a hung drive): the later moves and the plan itself then fail,
        and their slots stay reserved until that write ends, as it still reads from them."""
        for i, move in enumerate(plan.demotions):
            running: list[Future] = []  # its disk write, once submitted
            try:
                hung = self._move(move, running)
            except BaseException:  # an interrupt while its write runs: failed once it ends
                if running and not running[0].done():
                    running[0].add_done_callback(partial(self._fail_reservations, plan, i + 1))
                else:
                    self._fail_reservations(plan, i + 1)
                raise
            if hung is not None:
                hung.add_done_callback(partial(self._fail_reservations, plan, i + 1))
                return False
        return True

    def _fail_reservations(self, plan: StorePlan, first_move: int, _: Future | None = None) -> None:
        moves = plan.demotions[first_move:]
        aborted = [*((move.key, move.dst) for move in moves), (plan.key, plan.dst)]
        with self.state.books.held():  # a mark of a copy found wrong meanwhile goes with it
            for key, dst in aborted:
                self.state.was_unwanted(key, dst)
        self.state.books.abort(aborted)

    def _move(self, move: Move, running: list[Future]) -> Future | None:
        """Copy one chunk down a tier and finish its reservation. A write to disk runs on the
        I/O engine; one not over by ``load_timeout`` is left running and returned: it is
        counted and logged, and its reservation is finished when it ends."""
        if move.dst.tier is not DISK:
            result = IOResult(IOStatus.IO_ERROR, detail="move did not run")
            try:
                result = self.state.transfers.copy(move.key, move.src, move.dst)
                self.state.sync()
            finally:
                self.finish(move.key, move.dst, result.ok)
            return None
        if move.src.tier is not HOST:
            self._write_behind(move)
            return None
        return self._disk_move(move, partial(self.state.transfers.copy, move.key, move.src, move.dst),
                               running=running)

    def _write_behind(self, move: Move) -> None:
        """Write a device pool's victim to disk from a copy of its own in host memory, in
        the background (its slot is free once the copy is made, so a put never waits on the
        disk, nor on a hung one). At most ``max_pending`` such copies wait at once; past
        that the victim is dropped (counted in ``drops``)."""
        disk = self.state.transfers.disk
        assert disk is not None, "a move to disk needs the disk tier"
        with self.state.books.held() as b:
            if self._behind >= self.state.max_pending:
                b.stack.finish(move.key, move.dst, False)
                b.stack.drops += 1
                return
            self._behind += 1
        try:
            staged = self.state.transfers.staged(move.src)
            write = self.state.lane.submit(self.state.lane.move_queue_of(move.dst.slot),
                                            partial(disk.write, move.dst.slot, move.key, staged))
        except BaseException:  # the copy failed, or the engine is closed: nothing runs
            self._written_behind(move, None)
            raise
        write.add_done_callback(partial(self._written_behind, move))

    def _written_behind(self, move: Move, write: Future | None) -> None:
        with self.state.books.held():
            self._behind -= 1
        if write is None:
            self.finish(move.key, move.dst, False)
        else:
            self._moved(move, result_of(write))

    def write_staged(self, key: ChunkKey, staged: np.ndarray, dst: Location,
                     deadline: float | None = None) -> bool | None:
        """Write a chunk from ``staged`` (``Transfers.staged``) into disk slot ``dst``, which
        ``plan_store`` reserved, and finish that reservation: True when written, False when
        the write failed, None when it is not over by ``load_timeout`` or the caller's
        ``deadline`` (``time.monotonic()``), whichever comes first (left running)."""
        disk = self.state.transfers.disk
        assert disk is not None, "a staged write goes to the disk tier"
        move = Move(key, dst, dst)  # no memory slot to give back: the copy is the write's own
        if self._disk_move(move, partial(disk.write, dst.slot, key, staged), deadline) is not None:
            return None
        return self.state.books.slot_of(DISK, key) == dst.slot

    def _disk_move(self, move: Move, job: Callable[[], IOResult], deadline: float | None = None,
                   running: list[Future] | None = None) -> Future | None:
        """Run a write to disk slot ``move.dst`` on the I/O engine; see ``_move``. Waited for
        ``load_timeout`` at most, or until the caller's ``deadline`` where that is sooner
        (then left running, finished when it ends: the drive is not counted as hung)."""
        try:
            write = self.state.lane.submit(self.state.lane.move_queue_of(move.dst.slot), job)
        except BaseException:  # the engine is closed: nothing runs
            self.finish(move.key, move.dst, False)
            raise
        if running is not None:
            running.append(write)
        timeout, left = self.state.config.load_timeout, time_left(deadline)
        caller_first = left is not None and (timeout is None or left < timeout)
        try:
            result = write.result(timeout=left if caller_first else timeout)
        except TimeoutError:
            if caller_first:
                write.add_done_callback(lambda f: self._moved(move, result_of(f)))
                return write
            return self._left_running(move, write)
        except Exception as exc:  # the copy raised: a failed write, never a crash
            result = IOResult(IOStatus.IO_ERROR, detail=repr(exc))
        except BaseException:  # interrupted while waiting: the write goes on, and is
            write.add_done_callback(lambda f: self._moved(move, result_of(f)))  # finished
            raise  # when it ends (its slots stay reserved until then)
        self._moved(move, result)
        return None

    def _left_running(self, move: Move, write: Future) -> Future:
        """A write-back past ``load_timeout``: counted, logged once, and finished when it ends."""
        self.state.books.timed_out(move.dst.slot, "disk write-back timed_out", f"a chunk moving to disk got "
                        f"no answer after {self.state.config.load_timeout:g} s (load_timeout); the put "
                        "or get that needed its host slot went on without it")
        write.add_done_callback(lambda f: self._moved(move, result_of(f)))
        return write

    def _moved(self, move: Move, result: IOResult) -> None:
        if result.ok and move.dst.tier is DISK and self.state.forgotten:  # (empty but
            with self.state.books.held():  # for a removal: no lock taken on every write)
                wrong = move.key in self.state.forgotten
            if wrong:  # found wrong while written: blanked, and not committed (``finish``;
                self.state.lane.invalidate(move.dst.slot, move.key)  # one marked since is
                # aborted there, and its slot blanked by ``forget``'s look at every copy)
        self.finish(move.key, move.dst, result.ok)
        self.state.books.account_write(result)

    def finish(self, key: ChunkKey, dst: Location, ok: bool, pin: bool = False) -> bool:
        """Finish a reservation (with ``pin``, pin the chunk there in the same breath); a
        chunk that reached host memory starts its write-through. A copy of a chunk found
        wrong meanwhile (``StoreState.forgotten`` for a disk write, ``unwanted`` for a
        memory tier) is not committed. True when the chunk is there now."""
        remote = self.state.remote
        with self.state.books.held() as b:
            if dst.tier is DISK and key in self.state.forgotten:  # found wrong meanwhile:
                self.state.forgotten.discard(key)  # its slot blanked (``_moved``), or if it
                ok = False  # was found since, by ``forget``'s look at every copy after
            ok = not self.state.was_unwanted(key, dst) and ok  # asked whatever ``ok``
            ok = b.stack.finish(key, dst, ok)
            if ok and pin:
                b.stack.indexes[dst.tier].pin(key)
            write = self.disk_writes.write_through(b, key, dst.slot) if ok and dst.tier is HOST else None
            if remote is not None and ok and dst.tier is HOST:
                remote.reached_host(b, key, dst.slot)
        try:
            if write is not None:
                self.disk_writes.start(write)
        finally:
            if remote is not None:
                remote.start()
        return ok

    @property
    def writes_behind(self) -> bool:
        """True when a chunk reaching host memory starts a background write (write-through
        to disk, or to the remote store)."""
        through = self.state.config.write_policy is WritePolicy.WRITE_THROUGH
        return (bool(self.disk_writes.groups) and through) or self.state.remote is not None

    def promote(self, key: ChunkKey, source: Location, keep: Collection[ChunkKey] = ()) -> None:
        """``key``, copied out from ``source``, copied to the top tier too, unless that
        would evict a chunk of ``keep`` (the get's) from any tier or drop another chunk for
        want of room below (``TierStack.plan_promotion``)."""
        plan = self.state.books.plan_promotion(key, self.state.books.top, keep)
        if plan is None:
            return
        if self.run(plan, partial(self.copy_in, self.state.transfers.run_of(source, 1))):
            self.state.books.count("chunks_promoted")


def result_of(write: Future) -> IOResult:
    """What a disk job over came to; a job cancelled or raising is a failed one."""
    try:
        return write.result()
    except BaseException as exc:  # cancelled at close, or an unexpected error
        return IOResult(IOStatus.IO_ERROR, detail=repr(exc))
