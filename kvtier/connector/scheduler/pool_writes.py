"""A producer's writes to the pool, seen through after its hand-off.

A producer hands a request off when vLLM finishes it, most often with its chunks' writes
to the pool still in flight (``PoolReach`` counts them), and vLLM frees the request's
blocks then. A write that fails after that would leave the consumer waiting
``load_timeout`` for a chunk that is not coming, then recomputing it. The chunk is still in
the producer's host memory (its slot pinned while its disk write runs), so it is written
again from there, up to ``POOL_WRITE_TRIES`` writes in all: a disk write to a slot planned
anew (a path out of service has none), the host slot pinned from the failure to the last
outcome (``DiskRewrites``); a remote write once the store is in service again
(``RemoteWrites``). A chunk with nowhere to go (no disk slot free, no longer in host memory)
or whose tries are spent is given up, counted: a consumer waits for it until
``load_timeout``, as before.

vLLM steps an engine only while it has requests, and the workers' outcomes reach the
scheduler side only with a step: so while a hand-off is recent (within the consumer's
wait) and pool writes are out, the connector asks vLLM to keep stepping
(``PoolWrites.pushing``, vLLM's ``has_pending_push_work``)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

from kvtier.config.settings import KVTierConfig
from kvtier.connector.common.messages import DiskWrite
from kvtier.connector.scheduler.handoff import WAIT_S_WITHOUT_LOAD_TIMEOUT, Role
from kvtier.connector.scheduler.pool_reach import PoolReach, shares_directory
from kvtier.connector.scheduler.records import PendingStores, Tracked
from kvtier.connector.scheduler.remote_writes import RemoteWrites
from kvtier.keys import ChunkKey
from kvtier.shared.follower import OtherWriters
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import Location, TierStack

POOL_WRITE_TRIES = 3  # a producer's writes of a chunk to the pool: the first, two more at most
DISK = TierName.DISK


def pool_write_tries(role: Role) -> int:
    """The writes of a chunk to the pool an engine of ``role`` makes at most: a producer's
    are written again when they fail (a consumer may be waiting for them), others' not."""
    return POOL_WRITE_TRIES if role is Role.PRODUCER else 1


class DiskRewrites:
    """Contract: ``over(key, ok, host)`` takes every rank's outcome of a write-through disk
    write of ``key`` (its host copy visible at ``host``, pinned): True when the chunk is to
    be written again (the pin is kept for it), False when the caller unpins it: written,
    or failed ``tries`` times (1: never written again). ``plan()`` (once a report's paths
    out of service are known) gives each chunk to write again a disk slot, recorded in
    ``pending.disk`` as a write-through write is, and its ``DiskWrite`` to ``take_new()``
    (``StepPlan.rewrites``);
    one no longer in host memory there, already on disk, or finding no disk slot free is
    given up, its host slot unpinned. ``busy()``: a chunk waits to be written again.
    Counters: ``pool_rewritten_chunks``, ``pool_given_up_chunks``."""

    def __init__(self, stack: TierStack, pending: PendingStores, counters: Counter,
                 tries: int) -> None:
        self._stack, self._pending, self._counters, self._tries = stack, pending, counters, tries
        self._made: dict[ChunkKey, int] = {}  # key -> writes made of it, the last one out
        self._due: dict[ChunkKey, Location] = {}  # key -> its host copy (pinned): write again
        self._new: list[DiskWrite] = []

    def over(self, key: ChunkKey, ok: bool, host: Location) -> bool:
        made = self._made.pop(key, 1)
        if ok or self._tries <= 1:
            return False
        if made >= self._tries:
            self._counters["pool_given_up_chunks"] += 1
            return False
        self._made[key] = made + 1
        self._due[key] = host
        return True

    def plan(self) -> None:
        due, self._due = self._due, {}
        for key, host in due.items():
            disk = self._stack.indexes[DISK]
            plan = None
            if self._stack.locate(key) == host and not disk.has_entry(key):
                plan = self._stack.plan_store(key, DISK)
            if plan is None:  # discarded, on disk by now, or no room on a path in service
                self._made.pop(key, None)
                self._stack.unpin(key, host)
                self._counters["pool_given_up_chunks"] += 1
                continue
            self._pending.disk[key] = (plan.dst, host)
            self._new.append(DiskWrite(key, host.slot, plan.dst.slot))
            self._counters["pool_rewritten_chunks"] += 1

    def take_new(self) -> list[DiskWrite]:
        new, self._new = self._new, []
        return new

    def busy(self) -> bool:
        return bool(self._due or self._new)


class PoolWrites:
    """A producer's writes to the pool and how far its hand-offs reach.

    Contract: ``tokens(tracked, keys)`` is ``PoolReach.tokens``; on a producer it also
    opens (or extends) a window as long as a consumer's wait (``load_timeout``; 30 s with
    it off) during which ``pushing()`` is True while any write to the pool is out: a
    write-through disk write (where the disk is a shared directory), one due again
    (``rewrites``), a remote write or one due again. ``rewrites`` writes a producer's
    failed disk writes again (``DiskRewrites``; never on other roles)."""

    def __init__(self, config: KVTierConfig, role: Role, stack: TierStack,
                 pending: PendingStores, remote: RemoteWrites | None, chunk_tokens: int,
                 counters: Counter, others: OtherWriters | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._reach = PoolReach(config, stack, pending, remote, chunk_tokens, others)
        self._producer = role is Role.PRODUCER
        self._disk = self._producer and shares_directory(config)
        self.rewrites = DiskRewrites(stack, pending, counters,
                                     pool_write_tries(role) if self._disk else 1)
        self._pending, self._remote, self._clock = pending, remote, clock
        self._wait_s = WAIT_S_WITHOUT_LOAD_TIMEOUT if config.load_timeout is None \
            else config.load_timeout
        self._until = float("-inf")  # end of the window that keeps an idle engine stepping

    def tokens(self, tracked: Tracked, keys: Sequence[ChunkKey]) -> int:
        if self._producer:
            self._until = self._clock() + self._wait_s
        return self._reach.tokens(tracked, keys)

    def pushing(self) -> bool:
        if self._clock() >= self._until:
            return False
        disk = self._disk and (bool(self._pending.disk) or self.rewrites.busy())
        return disk or (self._remote is not None and self._remote.busy())
