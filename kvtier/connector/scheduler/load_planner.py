"""Load planning: which cached chunks of a request to load into its GPU blocks, from where.

A match (``LoadPlanner.match``) tells vLLM how many tokens beyond those computed can load,
pinning nothing. The plan (``LoadPlanner.plan``) pins each chunk where it is, reserves a
host slot for a disk chunk to stage its read in, and queues one ``RequestLoad`` for the
workers. Once every rank reported the load over, ``LoadPlanner.finish`` ends the pins and
staging reservations and drops the chunks whose load failed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from kvtier.config.settings import KVTierConfig
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import (
    NULL_BLOCK,
    ChunkLoad,
    DiskWrite,
    GroupBlocks,
    RequestLoad,
    chunk_blocks,
)
from kvtier.connector.scheduler.decider import LoadDecider
from kvtier.connector.scheduler.load_match import READ, LoadMatcher
from kvtier.connector.scheduler.records import Load, PendingStores, StalledReads, Tracked
from kvtier.connector.scheduler.remote_presence import RemotePresence
from kvtier.connector.scheduler.remote_writes import RemoteWrites
from kvtier.keys import ChunkKey
from kvtier.shared.follower import OtherWriters
from kvtier.shared.reads import SlotRef
from kvtier.tiers.base import TierName
from kvtier.tiers.prefix import IN_REMOTE, InOther, InRemote, Ours, find
from kvtier.tiers.stack import StorePlan, TierStack

HOST, DISK, REMOTE = TierName.HOST, TierName.DISK, TierName.REMOTE
Source = Ours | InOther[tuple[SlotRef, ...]] | InRemote  # where a chunk of a load comes from


class LoadPlanner:
    """The loads of one engine: at most one in flight per request.

    Contract: ``match`` returns the tokens loadable beyond those computed and whether the
    load is asynchronous (from disk), or None for "ask again next step"; it reserves
    nothing. ``plan`` records a ``Load`` (``in_flight``) and queues its ``RequestLoad``,
    handed out once by ``take_new``. ``note_failed`` collects the keys some rank failed to
    load; ``finish`` then ends the load: staged chunks become visible (failed ones are
    freed, or held in ``StalledReads`` while a read given up on still runs), pins end, and
    failed chunks are discarded from every tier. Chunks no tier of this engine holds are
    looked for in other engines' segments (``others``, when given): loaded like disk chunks,
    from there, and forgotten there when a rank's read proved the copy bad (``note_failed``'s
    ``bad``), or failed otherwise too often in a row (``OtherWriters.read_failed``). Past
    those, the remote store is asked (``presence``, once per request, in the background: "ask again" until it
    answered); its chunks load like disk chunks too, and one whose read failed is not offered
    to the request again. Loads over tell ``remote_writes`` which chunks were hit, and which
    the store holds.
    """

    def __init__(self, config: KVTierConfig, geometry: KVGeometry, stack: TierStack,
                 decider: LoadDecider, counters: Counter, pending: PendingStores,
                 stalled: StalledReads, others: OtherWriters | None = None,
                 presence: RemotePresence | None = None,
                 remote_writes: RemoteWrites | None = None) -> None:
        self.config, self.geometry, self.stack, self.decider = config, geometry, stack, decider
        self.others, self.presence, self.remote_writes = others, presence, remote_writes
        self.counters, self._pending, self._stalled = counters, pending, stalled
        self._loads: dict[str, Load] = {}
        self._new: list[RequestLoad] = []
        self._failures: dict[str, set[bytes]] = {}
        self._bad: dict[str, set[bytes]] = {}  # of those, another engine's copy proved bad
        self._damaged: dict[str, set[bytes]] = {}  # of those, the remote store's copy
        # a chunk's token record from its request and index (``StorePlanner.record``), for the
        # store's log of a chunk a hit sends there; None: none kept
        self.records: Callable[[Any, int], bytes] | None = None
        self._matcher = LoadMatcher(config, geometry, stack, decider, counters, stalled, others,
                                    presence)

    def in_flight(self, req_id: str) -> Load | None:
        return self._loads.get(req_id)

    def tiers(self, req_id: str, tokens: int) -> dict[TierName, int]:
        """Tokens of a planned load by the tier they come from."""
        load = self._loads.get(req_id)
        if load is None or not load.tiers:
            return {}
        remote = min(tokens, load.tiers.get(REMOTE, 0))
        read = load.tiers.get(DISK, 0) + load.tiers.get(TierName.SHARED, 0)  # from storage
        disk = min(tokens - remote, read)
        tiers = {DISK: disk, HOST: tokens - disk - remote}
        if remote:
            tiers[REMOTE] = remote
        return tiers

    def take_new(self) -> list[RequestLoad]:
        """The loads planned since the last call."""
        new, self._new = self._new, []
        return new

    def match(self, tracked: Tracked, keys: list[ChunkKey], limit: int,
              num_computed: int) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed`` (``LoadMatcher.match``)."""
        return self._matcher.match(tracked, keys, limit, num_computed)

    # -- plan -----------------------------------------------------------------------------

    def plan(self, req_id: str, tracked: Tracked, keys: list[ChunkKey], block_ids: GroupBlocks,
             num_computed: int, num_external: int) -> None:
        """Pin the chunks covering ``[num_computed, num_computed + num_external)`` and queue
        their load into the request's GPU blocks."""
        geo = self.geometry
        start, end = num_computed, num_computed + num_external
        order = tuple(keys[start // geo.chunk_tokens:-(-end // geo.chunk_tokens)])
        load = Load([], [], num_external, {}, asynchronous=tracked.asynchronous,
                    order=order, keys=frozenset(order))
        if self.records is not None:
            load.request = tracked.request
        tracked.asynchronous = False  # what the match promised is used up
        chunks: list[ChunkLoad] = []
        demotions: list[DiskWrite] = []
        held = self.presence.held(req_id, keys) if self.presence is not None else None
        for c in range(start // geo.chunk_tokens, -(-end // geo.chunk_tokens)):
            first = max(start, c * geo.chunk_tokens) // geo.block_tokens - c * geo.blocks_per_chunk
            # the blocks holding tokens up to ``end``: the last one may be partly loaded (a
            # prompt's tail, or all but the last token of a chunk); vLLM computes the rest
            last = -(-min(end, (c + 1) * geo.chunk_tokens) // geo.block_tokens) - c * geo.blocks_per_chunk
            ids = chunk_blocks(block_ids, c * geo.blocks_per_chunk + first,
                               c * geo.blocks_per_chunk + last)
            tokens = min(end, (c + 1) * geo.chunk_tokens) - max(start, c * geo.chunk_tokens)
            if load.request is not None and c < len(keys):
                load.chunks[keys[c]] = c
            chunks.append(self._plan_chunk(keys[c] if c < len(keys) else None, ids, first,
                                           load, demotions,
                                           bool(held and c < len(held) and held[c]), tokens))
        for key in reversed(order):
            self.stack.touch(key)  # the head last: the most recent, the last of them evicted
        self._loads[req_id] = load
        self._new.append(RequestLoad(req_id, tuple(chunks), tuple(demotions), load.asynchronous))

    def _plan_chunk(self, key: ChunkKey | None, ids: tuple[int, ...], first: int,
                    load: Load, demotions: list[DiskWrite], in_remote: bool,
                    tokens: int) -> ChunkLoad:
        """One chunk of a load: pinned where it is, a disk chunk with a host slot to stage
        its read in (as one from another engine's segment, or ``in_remote``: the remote
        store), ``tokens`` of the load in it. A chunk gone since the match, on disk in a
        synchronous load, or with no host slot free is not loaded, nor is any chunk after it:
        the workers report their blocks invalid and vLLM recomputes them (the chunks stay
        cached). A chunk whose blocks are all out of their windows is a hit with nothing to
        copy; a disk chunk only some of whose KV cache groups have blocks in the load is
        read in part (those groups'), and its staging slot is freed after the load."""
        if key is not None and not load.cut and all(b == NULL_BLOCK for b in ids):
            return self._out_of_window(key, ids, first, load, in_remote, tokens)
        where = None if key is None or load.cut else self._where(key, in_remote)
        plan = None
        if key is not None and where is not None and where.tier in READ:
            where, plan = self._staging(key, where, load)
        if key is None or where is None:
            load.cut = True
            self.counters["load_skipped_chunks"] += 1
            return ChunkLoad(key or b"", ids, first, None)
        load.tiers[where.tier] = load.tiers.get(where.tier, 0) + tokens
        self.counters[f"load_chunks_{where.tier}"] += 1
        if isinstance(where, Ours) and where.tier is HOST:
            load.pinned.append((key, where.loc))
            self.stack.indexes[HOST].pin(key)
            return ChunkLoad(key, ids, first, where.loc.slot)
        assert plan is not None, "a chunk from storage loads through a host staging slot"
        return self._staged(key, ids, first, where, plan, load, demotions)

    def _staged(self, key: ChunkKey, ids: tuple[int, ...], first: int, where: Source,
                plan: StorePlan, load: Load, demotions: list[DiskWrite]) -> ChunkLoad:
        """A chunk read from storage into its staging slot: from this engine's disk (pinned
        there), another engine's segment or the remote store (nothing of ours to pin)."""
        refs = where.ref if isinstance(where, InOther) else None
        remote = isinstance(where, InRemote)
        if refs is not None:
            load.other[key] = refs
        elif isinstance(where, Ours):
            load.pinned.append((key, where.loc))
        else:
            load.remote.add(key)
        demotions += self._pending.demotion_writes(plan.demotions)
        load.staged.append(plan)
        disk_slot = where.loc.slot if isinstance(where, Ours) else None
        return ChunkLoad(key, ids, first, plan.dst.slot, disk_slot, other=refs, remote=remote,
                         parts=self._read_in_part(key, ids, load))

    def _out_of_window(self, key: ChunkKey, ids: tuple[int, ...], first: int, load: Load,
                       in_remote: bool, tokens: int) -> ChunkLoad:
        """A chunk no group keeps a block of: its bytes are not needed, wherever it is (or if
        it went away since the match)."""
        where = self.stack.locate(key)
        tier = where.tier if where is not None else REMOTE if in_remote else DISK
        load.tiers[tier] = load.tiers.get(tier, 0) + tokens
        self.counters["load_chunks_out_of_window"] += 1
        return ChunkLoad(key, ids, first, None)

    def _where(self, key: ChunkKey, in_remote: bool) -> Source | None:
        """Where ``key`` is hottest: here, in another engine's segment (with its slots
        there), or in the remote store; None when it went away since the match."""
        where = find(key, self.stack.locate, self.others.find if self.others else None)
        return IN_REMOTE if where is None and in_remote else where

    def _staging(self, key: ChunkKey, where: Source,
                 load: Load) -> tuple[Source | None, StorePlan | None]:
        """A chunk read from storage pinned (this engine's disk) with a host slot to stage
        in; (None, None) when no slot is free or the load is synchronous."""
        if isinstance(where, Ours):
            self.stack.indexes[DISK].pin(key)
        # its victim not one of this load's host chunks while another will do: evicted,
        # one would be read back from disk too, or (being written back) cut the load
        plan = self.stack.plan_store(key, HOST, load.keys) if load.asynchronous else None
        if plan is None:
            if isinstance(where, Ours):
                self.stack.unpin(key, where.loc)
            return None, None
        return where, plan

    def _read_in_part(self, key: ChunkKey, ids: tuple[int, ...], load: Load) -> tuple[int, ...] | None:
        """The KV cache groups whose parts a chunk read from storage (``ids``: the blocks it
        fills, each group's, group after group) needs, when not all of them: its staging
        slot will then hold part of a chunk, and is not kept after the load."""
        parts = self.geometry.groups_filled(ids)
        if parts is not None:
            load.partial.add(key)
            self.counters["load_chunks_in_part"] += 1
        return parts

    # -- finish ---------------------------------------------------------------------------

    def note_failed(self, req_id: str, keys: set[bytes], bad: set[bytes] | None = None,
                    damaged: set[bytes] | None = None) -> None:
        """Some rank failed to load ``keys`` of ``req_id``'s load; of those, its reads of
        another engine's copy of ``bad`` proved that copy bad, and the remote store's
        copies of ``damaged`` were missing or failed their checks."""
        self._failures.setdefault(req_id, set()).update(keys)
        if bad:
            self._bad.setdefault(req_id, set()).update(bad)
        if damaged:
            self._damaged.setdefault(req_id, set()).update(damaged)

    def finish(self, req_id: str) -> None:
        """The workers finished loading ``req_id``: keep what arrived, drop what failed."""
        failed = self._failures.pop(req_id, set())
        bad, damaged = self._bad.pop(req_id, set()), self._damaged.pop(req_id, set())
        load = self._loads.pop(req_id, None)
        if load is None:
            return
        for plan in load.staged:
            ok = plan.key not in failed
            if not ok and self._stalled.hold(plan):  # a read may still be filling the slot
                continue
            self.stack.finish(plan.key, plan.dst, ok and plan.key not in load.partial)
        for key, location in load.pinned:
            self.stack.unpin(key, location)
            if key in failed:
                self.stack.discard(key)
                self.counters["load_failed_chunks"] += 1
        for key, refs in load.other.items():
            if self.others is not None and key in failed:
                self.others.read_failed(refs, key in bad)
                self.counters["load_failed_chunks"] += 1
            elif self.others is not None:
                self.others.read_ok(refs)
        for key in reversed(load.order):  # its staged copies were committed head first:
            self.stack.touch(key)  # the head made the most recent again
        self._remote_outcomes(req_id, load, failed, damaged)

    def _remote_outcomes(self, req_id: str, load: Load, failed: set[bytes],
                         damaged: set[bytes]) -> None:
        """Chunks read from the remote store are known to be there; those whose read failed
        are not offered again for a while (``RemotePresence.failed``: the store may still
        say it holds them); chunks loaded from here earned a hit (``remote_min_hits``), and one whose hit
        sends it to the store goes with its token record (``records``) for the store's log."""
        lost = load.remote & failed
        self.counters["load_failed_chunks"] += len(lost)
        if lost and self.presence is not None:
            self.presence.failed(req_id, lost, lost & damaged)
        if self.remote_writes is None:
            return
        for key in load.remote - failed:
            self.remote_writes.in_store(key)
        for key, _ in load.pinned:
            if key in failed or not self.remote_writes.loaded(key):
                continue
            if self.records is not None and key in load.chunks:  # its record, for the log
                self.remote_writes.add_record(key, self.records(load.request, load.chunks[key]))
