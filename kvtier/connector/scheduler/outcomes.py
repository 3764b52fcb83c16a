"""What the workers said: a ``WorkerReport`` applied to the scheduler side's bookkeeping.

Ranks report in different steps (a background disk write ends when it ends), so each
outcome is counted over ranks (``rank_counts``) and applied once every rank has spoken:
a chunk becomes visible only when every rank stored it, a load ends only when every rank
is done with it.
"""

from __future__ import annotations

from collections import Counter

from kvtier.connector.common.messages import WorkerReport
from kvtier.connector.scheduler.decider import LoadDecider
from kvtier.connector.scheduler.load_planner import LoadPlanner
from kvtier.connector.scheduler.paths_back import DiskPathsBack
from kvtier.connector.scheduler.payoff import Payoff
from kvtier.connector.scheduler.pool_writes import DiskRewrites
from kvtier.connector.scheduler.rank_counts import RankCount, RankOutcomes
from kvtier.connector.scheduler.records import AbortedStores, PendingStores, StalledReads
from kvtier.connector.scheduler.remote_writes import RemoteWrites
from kvtier.connector.scheduler.verify_planner import VerifyPlanner
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import TierStack

HOST, DISK = TierName.HOST, TierName.DISK


class Outcomes:
    """Applies the workers' reports, in this order: load bandwidth samples (to the
    decider); loads (failed keys, reads given up on, loads every rank is done with, which
    ``LoadPlanner.finish`` ends); sampled checks (``VerifyPlanner.apply``); host stores
    (with a remote write, its host slot pinned until it is over: ``RemoteWrites``); disk
    writes; remote writes; given-up reads that ended; disk paths out of service and back.

    Contract: a pending host store ends (``TierStack.finish``) once every rank reported
    it, visible only when none failed; a stored chunk's write-through copy keeps its host
    slot pinned until the disk write ends. When some rank failed the host store, its host
    reservation (and its write-through disk reservation) ends only once every rank's disk
    and remote outcomes are in (``AbortedStores``): other ranks may still read the slot, and
    the chunk never becomes visible; so do write-back demotions still writing from the slot
    (a worker gives up waiting for them after ``load_timeout``, and fails the stores into
    their slots). A pending disk write ends the same way; one of a stored chunk that failed
    may be written again from its host slot, kept pinned (``rewrites``: a producer's). Disk
    paths out of service and back: ``paths`` (``DiskPathsBack``). Outcomes of keys not
    pending are ignored.
    """

    def __init__(self, world_size: int, stack: TierStack, counters: Counter,
                 loads: LoadPlanner, decider: LoadDecider, pending: PendingStores,
                 stalled: StalledReads, paths: DiskPathsBack | None,
                 remote_writes: RemoteWrites | None = None,
                 verify: VerifyPlanner | None = None,
                 rewrites: DiskRewrites | None = None,
                 aborted: AbortedStores | None = None) -> None:
        self._verify, self._rewrites = verify, rewrites
        self.world_size, self.stack, self.counters = world_size, stack, counters
        self._loads, self._decider = loads, decider
        self._pending, self._stalled = pending, stalled
        self._remote_writes = remote_writes
        self._loads_done = RankCount()  # req id -> ranks whose load is over
        self.paths = paths
        self._host_outcomes = RankOutcomes(world_size)  # key -> ranks stored, failed
        self._disk_outcomes = RankOutcomes(world_size)
        self._aborted = AbortedStores(stack) if aborted is None else aborted  # (verify's too)
        self.payoff = Payoff(counters, lambda: decider.prefill_seconds_per_token.value)

    def apply(self, report: WorkerReport) -> None:
        for disk_bytes, host_bytes, seconds in report.load_samples:
            self._decider.observe_load(disk_bytes, host_bytes, seconds)
        self._loads_over(report)
        if self._verify is not None:  # after the reads given up on are known
            self._verify.apply(report)
        self._host_stores(report)
        self._disk_writes(report)
        if self._remote_writes is not None:
            self._remote_writes.apply(report)
        for key, ranks in report.reads_over.items():
            plan = self._stalled.over(key, ranks)
            if plan is not None:
                self.stack.finish(plan.key, plan.dst, False)
        if self.paths is not None:
            self.paths.apply(report)
        if self._rewrites is not None:  # once the paths out of service are known
            self._rewrites.plan()

    def step(self) -> None:
        """Once a scheduler step: a few chunks of a disk path back adopted (``DiskPathsBack``)."""
        if self.paths is not None:
            self.paths.step()

    def adopting(self) -> bool:
        return self.paths is not None and self.paths.adopting

    def _loads_over(self, report: WorkerReport) -> None:
        for req_id, keys in report.load_failed.items():
            self._loads.note_failed(req_id, keys, keys & report.other_bad,
                                    keys & report.remote_absent)
        if self._remote_writes is not None:
            for key in report.remote_absent:  # written again at its next store
                self._remote_writes.lost(ChunkKey(key))
        if report.remote_absent and self._loads.presence is not None:  # for the KV events
            self._loads.presence.gone(ChunkKey(key) for key in report.remote_absent)
        for key, ranks in report.reads_stalled.items():
            self._stalled.stalled(key, ranks)
        for req_id, seconds in report.load_seconds.items():
            self.payoff.took(req_id, seconds)
        for req_id, ranks in report.loads_done.items():
            if self._loads_done.reached(req_id, ranks, self.world_size):
                load = self._loads.in_flight(req_id)
                self.payoff.over(req_id, load.tiers if load is not None else None)
                self._loads.finish(req_id)

    def _host_stores(self, report: WorkerReport) -> None:
        reported = report.host_stored.keys() | report.host_failed.keys()
        if not reported:
            return
        # in the reverse of the order they were planned: a prompt's last chunk enters the
        # eviction order first and goes first, its first chunk last (as vLLM frees a
        # request's blocks): a key names its whole prefix, so a prompt's first chunk gone
        # leaves its later ones in memory with no hit
        for key in reversed([key for key in self._pending.host if key in reported]):
            ok = self._host_outcomes.add(key, report.host_stored[key], report.host_failed[key])
            if ok is None:
                continue
            dst, disk = self._pending.host.pop(key)
            remote = self._remote_writes
            self.counters["stored_chunks" if ok else "store_failed_chunks"] += 1
            writing = disk is not None and key in self._pending.disk
            if ok:
                self.stack.finish(key, dst, True)
                if remote is not None:
                    remote.stored(key, dst)
                if writing:
                    self.stack.indexes[HOST].pin(key)  # until its disk write is over
                continue
            # Some rank failed its copy; ranks whose copy succeeded may still be sending from
            # the host slot (to disk, to the store): it is ended once every rank's outcomes
            # are in, and the disk slot too (never two writes racing into one).
            readers = int(writing)
            if remote is not None and remote.hold_failed(key, dst, self._aborted.release):
                readers += 1
            if readers:
                self._aborted.hold(key, dst, readers)
            # a write-back past load_timeout still reading the slot holds it too
            if not self._aborted.after_write_back(key, dst, self._pending) and not readers:
                self.stack.finish(key, dst, False)

    def _disk_writes(self, report: WorkerReport) -> None:
        for key in set(report.disk_written) | set(report.disk_failed):
            if key not in self._pending.disk:
                continue
            ok = self._disk_outcomes.add(key, report.disk_written[key], report.disk_failed[key])
            if ok is None:
                continue
            dst, host = self._pending.disk.pop(key)
            self._pending.demoted(key)
            self._aborted.written_back(key)  # a store or a check into its slot that failed
            aborted = key in self._aborted
            ok = self.stack.finish(key, dst, ok and not aborted)  # False: its path went down
            self.counters["disk_written_chunks" if ok else "disk_failed_chunks"] += 1
            if aborted:
                self._aborted.release(key)
            elif host is not None and not (self._rewrites is not None
                                           and self._rewrites.over(key, ok, host)):
                self.stack.unpin(key, host)  # else pinned still: written again from there

