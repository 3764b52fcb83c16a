"""One ``KVStore.put``: a plan per chunk, and the chunks copied in runs (chunks bound for
slots that follow one another in one memory tier go in one copy, not one each; a fresh
store, or one evicting in the order it was filled, hands out slots in order)."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.keys import ChunkKey
from kvtier.store.chunk_runs import Run
from kvtier.store.skip import Skip
from kvtier.store.state import StoreState
from kvtier.store.writes import PlanRunner
from kvtier.tiers.stack import StorePlan

RUN_BYTES = 64 * 1024**2  # at most this much is held back for one copy
# ... and this much when each chunk reaching host memory starts a background write: longer
# runs hold the writes back and then queue them all at once, past the write queue's bound
# (put + flush of 2 MiB chunks, write-through to disk: 0.85x with 64 MiB runs, 1.03x with 4)
RUN_BYTES_WRITING = 4 * 1024**2


class PutRuns:
    """The chunks of one ``put``, filled a run at a time.

    Contract: ``chunks_of(i, n)`` is chunks ``i`` to ``i + n - 1`` of the KV put, as one
    ``(n, layers, 2, tokens, hidden)`` run (``chunk_runs``). ``add(index, plan)`` runs the
    plan's demotions and holds back the copy of chunk ``index`` into ``plan.dst``. A plan that continues the
    held run (the next chunk, into the next slot of the same tier, within ``RUN_BYTES``, or
    ``RUN_BYTES_WRITING`` when chunks reaching host memory are written in the background)
    joins it; any other first fills the run held. ``fill()`` copies the held run in with one
    copy and finishes its reservations; ``stored`` counts the chunks filled. The held run's
    slots are reserved, so nothing can be evicted from them: fill it before giving up on a
    plan for want of room. ``abort()`` fails the reservations of a run still held (after an
    exception): call it in a ``finally``. A plan whose demotion to disk hangs is failed by
    the runner, not held.
    """

    def __init__(self, runner: PlanRunner, chunks_of: Callable[[int, int], Run],
                 chunk_bytes: int) -> None:
        self._runner, self._chunks_of = runner, chunks_of
        most = RUN_BYTES_WRITING if runner.writes_behind else RUN_BYTES
        self._most = max(1, most // chunk_bytes)
        self._plans: list[StorePlan] = []
        self._first = 0
        self.stored = 0

    def add(self, index: int, plan: StorePlan) -> None:
        if self._plans and not self._continues(index, plan):
            self.fill()
        if not self._runner.demote(plan):
            return
        if not self._plans:
            self._first = index
        self._plans.append(plan)
        if len(self._plans) >= self._most:
            self.fill()

    @property
    def held(self) -> int:
        """Chunks held back (reserved, not yet copied in)."""
        return len(self._plans)

    def _continues(self, index: int, plan: StorePlan) -> bool:
        last = self._plans[-1].dst
        return (index == self._first + len(self._plans) and plan.dst.tier is last.tier
                and plan.dst.slot == last.slot + 1)

    def fill(self) -> None:
        if not self._plans:
            return
        plans, self._plans = self._plans, []
        self._runner.fill_run(plans, self._chunks_of(self._first, len(plans)))
        self.stored += len(plans)

    def abort(self) -> None:
        plans, self._plans = self._plans, []
        for plan in plans:
            self._runner.finish(plan.key, plan.dst, False)


def put_chunks(state: StoreState, runner: PlanRunner, keys: list[ChunkKey],
               chunks_of: Callable[[int, int], Run], drain_timeout: float) -> int:
    """Store the chunks of ``keys`` not cached yet (chunk ``i`` is ``chunks_of(i, 1)``);
    return how many were stored. Chunks already cached are only marked recent; a chunk with
    no room, even after the run held is copied in and background writes were waited for
    once (at most ``drain_timeout`` seconds), is skipped and counted. So are the chunks
    past as many as the largest tier holds: a longer prefix would lose its own first chunks
    (evicted by the put itself, or by the gets that promote them to a smaller tier), and
    with them every later chunk's hit; with a remote store too (its writes go from host
    slots in the background: a chunk evicted before its write never gets there)."""
    books = state.books
    keep = max(books.slots.values())
    if len(keys) > keep:
        books.count("chunks_skipped", len(keys) - keep)
        keys = keys[:keep]
    runs = PutRuns(runner, chunks_of, state.transfers.chunk_bytes)
    may_wait = True
    try:
        for i, key in enumerate(keys):
            plan = books.plan_put(key)
            if plan is Skip.NO_ROOM and runs.held:  # the held run's slots are not victims yet
                runs.fill()
                plan = books.plan_put(key)
            if plan is Skip.NO_ROOM and may_wait and state.lane.pending():
                # Slots held by background writes: wait for them once (not for long if the
                # disk is hung), then try again.
                may_wait = state.lane.drain(timeout=drain_timeout)
                plan = books.plan_put(key)
            if not isinstance(plan, StorePlan):
                books.count("chunks_skipped")
                continue
            runs.add(i, plan)
        runs.fill()
    finally:
        runs.abort()
    return runs.stored

