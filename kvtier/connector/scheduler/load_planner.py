"""Load planning: which cached chunks of a request to load into its GPU blocks, from where.

A match (``LoadPlanner.match``) tells vLLM how many tokens beyond those computed can load,
pinning nothing. The plan (``LoadPlanner.plan``) pins each chunk where it is, reserves a
host slot for a disk chunk to stage its read in, and queues one ``RequestLoad`` for the
workers. Once every rank reported the load over, ``LoadPlanner.finish`` ends the pins and
staging reservations and drops the chunks whose load failed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

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
from kvtier.connector.scheduler.records import Load, PendingStores, StalledReads, Tracked
from kvtier.connector.scheduler.remote_presence import RemotePresence
from kvtier.connector.scheduler.remote_writes import RemoteWrites
from kvtier.connector.scheduler.shares import EngineShares
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import Location, TierStack

HOST, DISK, SHARED, REMOTE = TierName.HOST, TierName.DISK, TierName.SHARED, TierName.REMOTE
READ = (DISK, SHARED, REMOTE)  # chunks read into a host slot before they load
COMPUTED = Location(TierName.GPU, -1)  # a chunk vLLM computed already: never loaded


class LoadPlanner:
    """The loads of one engine: at most one in flight per request.

    Contract: ``match`` returns the tokens loadable beyond those computed and whether the
    load is asynchronous (from disk), or None for "ask again next step"; it reserves
    nothing. ``plan`` records a ``Load`` (``in_flight``) and queues its ``RequestLoad``,
    handed out once by ``take_new``. ``note_failed`` collects the keys some rank failed to
    load; ``finish`` then ends the load: staged chunks become visible (failed ones are
    freed, or held in ``StalledReads`` while a read given up on still runs), pins end, and
    failed chunks are discarded from every tier. Chunks no tier of this engine holds are
    looked for in other engines' segments (``shares``, when given): loaded like disk chunks,
    from there, and forgotten there when a rank fails to read them. Past those, the remote
    store is asked (``presence``, once per request, in the background: "ask again" until it
    answered); its chunks load like disk chunks too, and one whose read failed is not offered
    to the request again. Loads over tell ``remote_writes`` which chunks were hit, and which
    the store holds.
    """

    def __init__(self, config: KVTierConfig, geometry: KVGeometry, stack: TierStack,
                 decider: LoadDecider, counters: Counter, pending: PendingStores,
                 stalled: StalledReads, shares: EngineShares | None = None,
                 presence: RemotePresence | None = None,
                 remote_writes: RemoteWrites | None = None) -> None:
        self.config, self.geometry, self.stack, self.decider = config, geometry, stack, decider
        self.shares, self.presence, self.remote_writes = shares, presence, remote_writes
        self.counters, self._pending, self._stalled = counters, pending, stalled
        self._loads: dict[str, Load] = {}
        self._new: list[RequestLoad] = []
        self._failures: dict[str, set[bytes]] = {}

    def in_flight(self, req_id: str) -> Load | None:
        return self._loads.get(req_id)

    def take_new(self) -> list[RequestLoad]:
        """The loads planned since the last call."""
        new, self._new = self._new, []
        return new

    # -- match ----------------------------------------------------------------------------

    def match(self, tracked: Tracked, keys: list[ChunkKey], limit: int,
              num_computed: int) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed`` (at most ``limit``) of the request whose
        chunks have ``keys``; see ``SchedulerSide.num_new_matched_tokens``."""
        chunk = self.geometry.chunk_tokens
        locations = self._match(keys, tracked.request.request_id, num_computed // chunk)
        if locations is None:
            return None, False
        hit = min(len(locations) * chunk, limit)
        wanted = hit - num_computed
        if wanted <= 0:
            return 0, False
        first = num_computed // chunk
        matched = locations[first:]
        loadable = self._loadable(keys[first:len(locations)], matched, first, hit)
        if loadable is None:
            return None, False
        if loadable < len(matched) and self._wait_for_room(tracked, matched, wanted, first, hit):
            return None, False
        tracked.waiting_since = None
        loadable, end = self._fit(keys, matched, first, hit, loadable)
        if loadable is None:
            return None, False
        needed = matched[:loadable]
        wanted = end - num_computed
        if wanted <= 0:
            self.counters["load_cut_chunks"] += len(matched) - loadable
            return 0, False
        from_disk = sum(1 for loc in needed if loc.tier in READ)
        if not self.decider.should_load(wanted, *self._load_bytes(needed, first, end)):
            return 0, False
        self.counters["load_cut_chunks"] += len(matched) - loadable
        # From host memory the copy is quick: done before this step's forward. From disk the
        # request waits (asynchronously) while other requests go on. Loads that must fail
        # whole (hybrid or sliding-window models) are all asynchronous: vLLM takes a failed
        # load back as a request only then.
        tracked.asynchronous = from_disk > 0 or self.geometry.loads_whole
        return wanted, tracked.asynchronous

    def _fit(self, keys: list[ChunkKey], matched: Sequence[Location], first: int, hit: int,
             loadable: int) -> tuple[int | None, int]:
        """(chunks that can load, the load's end) once a hit of ``matched`` (chunks ``first``
        on, up to token ``hit``) is cut to its first ``loadable`` chunks: a window ends where
        the load ends, so the cut moves it onto chunks that needed nothing before, which may
        need host slots now (a model whose every group is windowed). None: ask again."""
        chunk = self.geometry.chunk_tokens
        end = min(hit, (first + loadable) * chunk)
        while loadable < len(matched):
            fit = self._loadable(keys[first:first + loadable], matched[:loadable], first, end)
            if fit is None or fit >= loadable:
                return fit, end
            loadable, end = fit, min(hit, (first + fit) * chunk)
        return loadable, end

    def _match(self, keys: list[ChunkKey], req_id: str, computed: int) -> list[Location] | None:
        """The longest run of ``keys`` cached here, or in another engine's segment (a
        location of tier SHARED), each where it is hottest, then in the remote store (tier
        REMOTE); None while the store has not answered yet. The first ``computed`` chunks
        vLLM holds already count as found (``COMPUTED``): one of them missing here hides no
        later chunk (a key names its whole prefix, so a later hit is still the right one)."""
        locations = [COMPUTED] * min(computed, len(keys))
        for key in keys[len(locations):]:
            location = self.stack.locate(key)
            if location is None and self.shares is not None and self.shares.find(key):
                location = Location(SHARED, -1)
            if location is None:
                break
            locations.append(location)
        if len(locations) < len(keys) and self.presence is not None:
            held = self.presence.held(req_id, keys)
            if held is None:
                return None
            for found in held[len(locations):]:
                if not found:
                    break
                locations.append(Location(REMOTE, -1))
        return locations

    def _wait_for_room(self, tracked: Tracked, matched: Sequence[Location], wanted: int,
                       first: int, end: int) -> bool:
        """Whether a request whose hits do not all fit in the host slots free now should ask
        again next step rather than recompute the rest: the slots are held by loads and
        stores in flight, which give them back within a step or two. Not when the hits could
        not fit even then (host memory too small, or slots held by reads a hung disk has not
        answered), when loading them would not pay (``load_policy``), or once the request has
        waited ``staging_wait``."""
        limit = self.config.staging_wait
        slots = sum(1 for n in range(len(matched)) if self.geometry.bytes_needed(first + n, end))
        if limit is None or slots > self.stack.indexes[HOST].num_slots - len(self._stalled):
            return False
        now = time.monotonic()
        if tracked.waiting_since is None:
            tracked.waiting_since = now
        if now - tracked.waiting_since >= limit:
            return False
        if not self.decider.would_load(wanted, *self._load_bytes(matched, first, end)):
            return False
        self.counters["room_waits"] += 1
        return True

    def _load_bytes(self, locations: Sequence[Location], first: int, end: int) -> tuple[int, int]:
        """(bytes read from disk, bytes in all) to load the chunks at ``locations`` (chunks
        ``first`` on) up to token ``end``: only the groups' parts that keep blocks there."""
        sizes = [self.geometry.bytes_needed(first + n, end) for n in range(len(locations))]
        return (sum(size for size, loc in zip(sizes, locations, strict=True) if loc.tier in READ),
                sum(sizes))

    def _loadable(self, keys: list[ChunkKey], locations: Sequence[Location], first: int,
                  end: int) -> int | None:
        """How many of the matched chunks (in order, chunks ``first`` on) can load now, up to
        token ``end``: each holds a host slot while it loads (a disk read needs one to stage
        in; a host chunk not yet pinned takes one out of reach when this load pins it), but
        for a chunk out of every group's window (nothing to copy). None when one of them is
        being staged into host memory by another load."""
        host = self.stack.indexes[HOST]
        room = host.reusable_slots
        for n, (key, loc) in enumerate(zip(keys, locations, strict=True)):
            if loc.tier in READ and host.has_entry(key):
                return None
            if not self.geometry.bytes_needed(first + n, end):
                continue
            cost = 0 if loc.tier is HOST and host.pinned(key) else 1
            if cost > room:
                return n
            room -= cost
        return len(locations)

    # -- plan -----------------------------------------------------------------------------

    def plan(self, req_id: str, tracked: Tracked, keys: list[ChunkKey], block_ids: GroupBlocks,
             num_computed: int, num_external: int) -> None:
        """Pin the chunks covering ``[num_computed, num_computed + num_external)`` and queue
        their load into the request's GPU blocks."""
        geo = self.geometry
        start, end = num_computed, num_computed + num_external
        load = Load([], [], num_external, {}, asynchronous=tracked.asynchronous)
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
            chunks.append(self._plan_chunk(keys[c] if c < len(keys) else None, ids, first,
                                           load, demotions,
                                           bool(held and c < len(held) and held[c]), tokens))
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
            # no group keeps a block of it: its bytes are not needed, wherever it is (or if
            # it went away since the match)
            where = self.stack.locate(key)
            tier = where.tier if where is not None else REMOTE if in_remote else DISK
            load.tiers[tier] = load.tiers.get(tier, 0) + tokens
            self.counters["load_chunks_out_of_window"] += 1
            return ChunkLoad(key, ids, first, None)
        location = self.stack.locate(key) if key is not None and not load.cut else None
        refs = None
        if key is not None and location is None and not load.cut and self.shares is not None:
            refs = self.shares.find(key)
            location = Location(SHARED, refs[0].slot) if refs else None
        if key is not None and location is None and not load.cut and in_remote:
            location = Location(REMOTE, -1)
        plan = None
        if key is not None and location is not None and location.tier in READ:
            if location.tier is DISK:
                self.stack.indexes[DISK].pin(key)
            plan = self.stack.plan_store(key, HOST) if load.asynchronous else None
            if plan is None:
                if location.tier is DISK:
                    self.stack.unpin(key, location)
                location = None
        if key is None or location is None:
            load.cut = True
            self.counters["load_skipped_chunks"] += 1
            return ChunkLoad(key or b"", ids, first, None)
        load.tiers[location.tier] = load.tiers.get(location.tier, 0) + tokens
        self.counters[f"load_chunks_{location.tier}"] += 1
        if refs is not None:  # nothing of ours to pin: the host slot it is read into
            assert plan is not None, "another engine's chunk loads through a host staging slot"
            load.foreign[key] = refs
            demotions += self._pending.demotion_writes(plan.demotions)
            load.staged.append(plan)
            return ChunkLoad(key, ids, first, plan.dst.slot, foreign=refs,
                             parts=self._read_in_part(key, ids, load))
        if location.tier is REMOTE:  # as from another engine's segment: nothing to pin
            assert plan is not None, "a remote chunk loads through a host staging slot"
            load.remote.add(key)
            demotions += self._pending.demotion_writes(plan.demotions)
            load.staged.append(plan)
            return ChunkLoad(key, ids, first, plan.dst.slot, remote=True,
                             parts=self._read_in_part(key, ids, load))
        load.pinned.append((key, location))
        if location.tier is HOST:
            self.stack.indexes[HOST].pin(key)
            return ChunkLoad(key, ids, first, location.slot)
        assert plan is not None, "a disk chunk loads through a host staging slot"
        demotions += self._pending.demotion_writes(plan.demotions)
        load.staged.append(plan)
        return ChunkLoad(key, ids, first, plan.dst.slot, location.slot,
                         parts=self._read_in_part(key, ids, load))

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

    def note_failed(self, req_id: str, keys: set[bytes]) -> None:
        """Some rank failed to load ``keys`` of ``req_id``'s load."""
        self._failures.setdefault(req_id, set()).update(keys)

    def finish(self, req_id: str) -> None:
        """The workers finished loading ``req_id``: keep what arrived, drop what failed."""
        failed = self._failures.pop(req_id, set())
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
        for key, refs in load.foreign.items():
            if key in failed and self.shares is not None:
                self.shares.drop(refs)
                self.counters["load_failed_chunks"] += 1
        self._remote_outcomes(req_id, load, failed)

    def _remote_outcomes(self, req_id: str, load: Load, failed: set[bytes]) -> None:
        """Chunks read from the remote store are known to be there; those whose read failed
        are not offered again (``RemotePresence.failed``: the store may still say it holds
        them); chunks loaded from here earned a hit (``remote_min_hits``)."""
        lost = load.remote & failed
        self.counters["load_failed_chunks"] += len(lost)
        if lost and self.presence is not None:
            self.presence.failed(req_id, lost)
        if self.remote_writes is None:
            return
        for key in lost:
            self.remote_writes.lost(ChunkKey(key))
        for key in load.remote - failed:
            self.remote_writes.in_store(key)
        for key, _ in load.pinned:
            if key not in failed:
                self.remote_writes.loaded(key)
