"""Sampled verification in vLLM (``verify_sample``): a hit checked against a recompute.

A checksum proves a chunk holds the bytes written under its key, not that they are the
right bytes for it (a writer that mislabels, a page copy bug, a layout changed under the
same name). At the ``verify_sample`` rate, a request that would hit is reported to vLLM as a
miss; vLLM computes its prompt, and as each of its cached chunks is computed again the
workers compare the fresh pages with the copy that would have served it (``ChunkVerify``).
A copy that differs is removed from every tier this engine reaches; past
``verify_halt_after`` of them the engine serves no hit until an operator clears it
(``VerifyHalt``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.config.settings import KVTierConfig
from kvtier.connector.common.messages import NULL_BLOCK, ChunkLoad, ChunkVerify, StepPlan, WorkerReport
from kvtier.connector.scheduler.records import AbortedStores, PendingStores, StalledReads, Tracked
from kvtier.connector.scheduler.remote_presence import RemotePresence
from kvtier.connector.scheduler.remote_writes import RemoteWrites
from kvtier.connector.scheduler.verify_halt import VerifyHalt
from kvtier.keys import ChunkKey
from kvtier.shared.follower import OtherWriters
from kvtier.tiers.base import TierName
from kvtier.tiers.prefix import InOther, Ours, find
from kvtier.tiers.stack import Location, StorePlan, TierStack

log = logging.getLogger("kvtier")
HOST, DISK, REMOTE = TierName.HOST, TierName.DISK, TierName.REMOTE
MAX_IN_FLIGHT = 16  # chunks being checked at once; no request is sampled past it
STAGE_SHARE = 0.5  # of the host slots, at most this share staging checked copies at once


@dataclass
class _Check:
    """One chunk being checked: what it pins, until every rank has answered."""

    tier: TierName
    pinned: list[tuple[ChunkKey, Location]]
    staged: StorePlan | None
    refs: tuple | None  # another engine's segment's copy
    req_id: str  # the sampled request's
    verified: int = 0
    differed: int = 0
    failed: int = 0
    undecided: int = 0  # bytes differed in a format kvtier cannot decode
    skipped: int = 0  # not made: the step's computed KV may be wrong
    bad: bool = False  # some rank's read proved another engine's copy bad
    damaged: bool = False  # some rank read the store's copy missing or failing its checks


class VerifyPlanner:
    """The sampled checks of one engine.

    Contract: ``sample(tracked, keys, computed)`` (the request's chunks; ``computed``: how
    many of them vLLM's own prefix cache holds) is True for ``verify_sample`` of the
    requests that would hit, decided once per request however often vLLM asks (every
    1/rate-th: spread evenly, the same run to run), never past ``MAX_IN_FLIGHT`` checks, nor
    with ``verify_sample`` 0; the caller then reports a miss. The chunks vLLM held already
    are never checked (``tracked.verify_from``): it did not compute them for this request,
    and they may be kvtier's own bytes loaded earlier; ``held`` follows them at every ask
    about a sampled request, whether it would hit then or not. ``plan`` adds a ``ChunkVerify`` to the
    step's plan (True) for a sampled request's chunk vLLM has just computed (``blocks``: the first pages
    of a prompt's tail), pinned where it is cached (a copy on storage gets a host slot to
    stage its read, after any write-back out of that slot); not for a chunk already being
    checked, one still being written (``_writing``), one no tier holds any more, one with
    no host slot free to stage it in, nor past ``MAX_IN_FLIGHT`` chunks being checked or
    ``STAGE_SHARE`` of the host slots staging them (the chunk is then only touched).
    ``apply`` folds the workers' answers: once every rank has, the pins end; a copy that
    matched on every rank counts as verified (kept but counted apart, never halting, where
    some rank could not tell: bytes of a format kvtier cannot decode differed); one that
    differed on any is removed from every tier (this engine's, the shared directory's copy
    it read, the remote store), counted by tier, logged, and told to ``halt``; one some
    rank could not read (damaged, an I/O error, a read given up at ``load_timeout``) counts
    as neither and is dropped where it was read, as a failed load's copy is: a copy left
    visible beside a staging slot a hung read still holds would look as if another load
    were staging it, to every later request. Another engine's copy is dropped only when the
    read proved it bad, or failed too often in a row (``OtherWriters.read_failed``): a hit
    ends at a chunk whose staging slot such a read holds (``LoadMatcher``).
    """

    def __init__(self, config: KVTierConfig, stack: TierStack, counters: Counter,
                 world_size: int, pending: PendingStores, stalled: StalledReads,
                 others: OtherWriters | None, presence: RemotePresence | None,
                 remote_writes: RemoteWrites | None, halt: VerifyHalt,
                 aborted: AbortedStores | None = None) -> None:
        self.rate, self.stack, self.counters = config.verify_sample, stack, counters
        self.world_size, self._pending, self._stalled = world_size, pending, stalled
        self._aborted = AbortedStores(stack) if aborted is None else aborted
        self.others, self.presence, self.remote_writes = others, presence, remote_writes
        self.halt = halt
        self._share = 0.0  # hits since the last sample, times the rate
        self._checks: dict[ChunkKey, _Check] = {}
        self._said_undecided = False

    def sample(self, tracked: Tracked, keys: Sequence[ChunkKey] = (), computed: int = 0) -> bool:
        if not tracked.verify:
            if tracked.verify_asked or not self.rate or len(self._checks) >= MAX_IN_FLIGHT:
                return False
            tracked.verify_asked = True
            self._share += self.rate
            if self._share < 1.0 - 1e-9:
                return False
            self._share -= 1.0
            tracked.verify = True
            self.counters["verify_sampled_requests"] += 1
            held = self.presence.held(tracked.request.request_id, keys) if self.presence else None
            tracked.verify_remote = frozenset(k for k, there in zip(keys, held or (), strict=False)
                                              if there)  # the store's chunks, to check there
        self.held(tracked, computed)
        return True

    def held(self, tracked: Tracked, computed: int) -> None:
        """vLLM asked about a request whose first ``computed`` chunks its own prefix cache
        holds: of a sampled request, those are never checked (at each ask, hit or not: a
        request that waited may find its prefix loaded by another meanwhile)."""
        if tracked.verify:
            tracked.verify_from = max(tracked.verify_from, computed)

    def plan(self, tracked: Tracked, key: ChunkKey, ids: tuple[int, ...], meta: StepPlan,
             blocks: int | None = None) -> bool:
        if key in self._checks or len(self._checks) >= MAX_IN_FLIGHT or NULL_BLOCK in ids \
                or self._writing(key):
            return False
        where = find(key, self.stack.locate, self.others.find if self.others else None)
        remote = where is None and key in tracked.verify_remote
        if where is None and not remote:
            return False
        pinned: list[tuple[ChunkKey, Location]] = []
        disk = self.stack.indexes.get(DISK)
        disk_slot = disk.pin(key) if disk is not None else None  # the copy a restart finds
        if disk_slot is not None:
            pinned.append((key, Location(DISK, disk_slot)))
        tier = REMOTE if where is None else where.tier
        if isinstance(where, Ours) and tier is HOST:
            self.stack.indexes[HOST].pin(key)
            pinned.append((key, where.loc))
            source = ChunkLoad(key, ids, 0, where.loc.slot)
            self._checks[key] = _Check(tier, pinned, None, None, tracked.request.request_id)
        else:
            staged = self.stack.plan_store(key, HOST) if self._may_stage() else None
            if staged is None:  # no host slot free now to stage the copy in
                for pin in pinned:
                    self.stack.unpin(*pin)
                return False
            meta.demotions += self._pending.demotion_writes(staged.demotions)
            refs = where.ref if isinstance(where, InOther) else None
            source = ChunkLoad(key, ids, 0, staged.dst.slot, disk_slot if tier is DISK else None,
                               other=refs, remote=remote)
            self._checks[key] = _Check(tier, pinned, staged, refs, tracked.request.request_id)
        meta.verifies.append(ChunkVerify(source, str(tier), disk_slot, blocks))
        return True

    def _may_stage(self) -> bool:
        """Whether one more check may take a host slot to stage its copy in: at most
        ``STAGE_SHARE`` of them at once (at least one), so checks never crowd out loads."""
        staging = sum(check.staged is not None for check in self._checks.values())
        return staging < max(1, int(self.stack.indexes[HOST].num_slots * STAGE_SHARE))

    def _writing(self, key: ChunkKey) -> bool:
        """Being stored, or written to disk or the remote store: a copy removed now would
        land after (a write-through's commit), so it is checked at a later sample."""
        host = self.stack.indexes[HOST]
        return (host.has_entry(key) and self.stack.locate(key) is None) \
            or key in self._pending.disk \
            or (self.remote_writes is not None and self.remote_writes.writing(key))

    def apply(self, report: WorkerReport) -> None:
        answers = (report.verified, report.verify_differed, report.verify_failed,
                   report.verify_undecided, report.verify_skipped)
        for key in set().union(*answers):
            check = self._checks.get(key)
            if check is None:
                continue
            check.verified += report.verified[key]
            check.differed += report.verify_differed[key]
            check.failed += report.verify_failed[key]
            check.undecided += report.verify_undecided[key]
            check.skipped += report.verify_skipped[key]
            check.bad = check.bad or key in report.other_bad
            check.damaged = check.damaged or key in report.remote_absent
            if check.verified + check.differed + check.failed + check.undecided \
                    + check.skipped >= self.world_size:
                del self._checks[key]
                self._end(key, check)

    def _end(self, key: ChunkKey, check: _Check) -> None:
        ok = check.differed == 0 and check.failed == 0
        staged = check.staged  # kept while a read into it, or a write-back from it, runs
        if staged is not None and not (check.failed and (self._stalled.hold(staged)
                                         or self._aborted.after_write_back(key, staged.dst, self._pending))):
            self.stack.finish(key, staged.dst, ok and not check.skipped)  # a copy read and
        for pin in check.pinned:  # right is kept (one a rank never read is not)
            self.stack.unpin(*pin)
        if check.skipped and not check.failed:  # no verdict, whatever another rank found
            # (its KV came through this rank's in the all-reduce): kept, nothing counted
            log.debug("kvtier: a sampled check of chunk %s was not made", key.hex()[:16])
        elif ok and check.undecided:
            self._undecided(key)
        elif ok:
            self.counters["chunks_verified"] += 1
        elif check.differed:
            self._remove(key, check)
        else:
            self._unread(key, check)

    def _undecided(self, key: ChunkKey) -> None:
        """Bytes that differ in a format kvtier cannot decode: a recompute need not give the
        same bytes, so it is neither right nor wrong; kept, counted apart, never halting."""
        self.counters["verify_undecided_chunks"] += 1
        if not self._said_undecided:
            self._said_undecided = True
            log.warning("kvtier: a sampled chunk's cached bytes differ from what vLLM computed, "
                        "in a KV cache format kvtier cannot decode (chunk %s): not taken for "
                        "wrong KV (kvtier_verify_undecided_total); set verify_tolerance = 0 "
                        "where this engine computes the same bytes every time", key.hex()[:16])

    def _unread(self, key: ChunkKey, check: _Check) -> None:
        """A copy some rank could not read: dropped where it was read (this engine's tier;
        the other engine's copy in this view when the read proved it bad, or after several
        failed reads of it in a row), or not offered from the store for a while (a
        read the store answered missing or damaged: forgotten as lost through the workers'
        ``remote_absent``, as a load's; one that timed out or failed is no loss)."""
        self.counters["verify_unread_chunks"] += 1
        if check.tier is REMOTE:
            if self.presence is not None:  # (distrusted the longer when damaged)
                self.presence.failed(check.req_id, [key], [key] if check.damaged else [])
        elif check.refs is not None:
            if self.others is not None:  # as a failed load's read of it
                self.others.read_failed(check.refs, check.bad)
        else:
            self.stack.discard(key)

    def _remove(self, key: ChunkKey, check: _Check) -> None:
        """A copy that differs from what the engine computed: gone from every tier."""
        self.counters["chunks_verified"] += 1
        self.counters[f"verify_mismatches_{check.tier}"] += 1
        self.stack.discard(key)
        if check.refs is not None and self.others is not None:
            self.others.drop(check.refs)
        if self.presence is not None:
            self.presence.remove([key])
        if self.remote_writes is not None:
            self.remote_writes.lost(key)
        log.warning("kvtier: chunk %s (from %s) holds KV other than what vLLM computed for its "
                    "tokens: removed from every tier (a mislabelled write, a page copy bug or "
                    "a layout change; counted in kvtier_verify_mismatches_total)",
                    key.hex()[:16], check.tier)
        self.halt.mismatch()
