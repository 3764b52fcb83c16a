"""The connector's scheduler side: all of kvtier's bookkeeping for a vLLM engine.

It lives in the engine-core process, next to vLLM's scheduler, and never touches bytes: it
decides which chunks to load and store, in which host and disk slots, and tells the workers
through ``StepPlan``; the workers report outcomes back through ``WorkerReport``.
Every reservation is two-phase: a chunk becomes visible only after all ranks reported it
stored; chunks being loaded stay pinned until the load is over.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import KVTierConfig, LoadPolicy, WritePolicy
from kvtier.connector.decider import LoadDecider
from kvtier.connector.geometry import KVGeometry
from kvtier.connector.messages import (
    ChunkLoad,
    ChunkStore,
    DiskWrite,
    RequestLoad,
    StepPlan,
    WorkerReport,
)
from kvtier.connector.rank_counts import RankCount, RankOutcomes
from kvtier.io.buffers import align_up
from kvtier.io.index_file import SlotLayout, read_disk_index
from kvtier.keys import ChunkKey, Namespace, block_hash_chunk_key
from kvtier.tier_stack import Location, Move, StorePlan, TierStack
from kvtier.tiers.base import TierName
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.policy import make_policy

log = logging.getLogger("kvtier")
HOST, DISK = TierName.HOST, TierName.DISK


@dataclass
class _Load:
    """A request's load in flight: what is pinned, and staging slots to finish."""

    pinned: list[tuple[ChunkKey, Location]]
    staged: list[StorePlan]
    tokens: int
    tiers: dict[TierName, int]
    asynchronous: bool = False  # from disk: the request waits for it between steps
    cut: bool = False  # a chunk could not be loaded: it and the ones after are recomputed


@dataclass
class _Pending:
    """Chunks the workers are storing: host reservations, then write-through disk writes."""

    host: dict[ChunkKey, tuple[Location, Location | None]] = field(default_factory=dict)
    # disk slot, and the host slot pinned until the write is over (None: a demotion's)
    disk: dict[ChunkKey, tuple[Location, Location | None]] = field(default_factory=dict)


@dataclass
class _Tracked:
    """What the scheduler side keeps of one request until vLLM says it finished."""

    request: Any  # vLLM's Request
    stored_upto: int = 0  # chunks already offered for store
    asynchronous: bool = False  # what the last match promised vLLM
    waiting_since: float | None = None  # when it began to wait for host slots to stage in


class SchedulerSide:
    """Bookkeeping for one engine (all TP ranks share one index; each rank keeps its own
    shard of every chunk in the same slots, under its own namespace)."""

    def __init__(self, config: KVTierConfig, geometry: KVGeometry,
                 namespaces: list[Namespace], world_size: int) -> None:
        self.config, self.geometry, self.world_size = config, geometry, world_size
        slot_bytes = align_up(geometry.chunk_bytes)
        levels = [(HOST, SlotIndex(config.host_capacity // slot_bytes,
                                   make_policy(config.eviction_policy)))]
        self.disk_layout: SlotLayout | None = None
        if config.disk_paths:
            self.disk_layout = SlotLayout(geometry.chunk_bytes, len(config.disk_paths),
                                          config.disk_capacity)
            self.disk_layout.check_bounded()
            levels.append((DISK, SlotIndex(self.disk_layout.num_slots,
                                           make_policy(config.eviction_policy))))
        self.stack = TierStack(levels)
        self.decider = LoadDecider(config.load_policy is LoadPolicy.AUTO)
        self._namespace = namespaces[0]
        self._tracked: dict[str, _Tracked] = {}  # req id -> what is kept of it
        self._loads: dict[str, _Load] = {}
        self._new_loads: list[RequestLoad] = []
        self._pending = _Pending()
        self._load_failures: dict[str, set[bytes]] = {}
        self._loads_done = RankCount()  # req id -> ranks whose load is over
        self._ranks_down = RankCount()  # disk path index -> ranks without it
        self._host_outcomes = RankOutcomes(world_size)  # key -> ranks stored, failed
        self._stalled_ranks = RankCount()  # key -> ranks whose given-up read still runs
        self._stalled_plans: dict[bytes, StorePlan] = {}  # their staging slots, held till then
        self._disk_outcomes = RankOutcomes(world_size)
        self.counters: Counter = Counter()  # chunks loaded by tier, stored, written, failed
        self.recovered = self._recover(namespaces, self.disk_layout) if self.disk_layout else 0

    def _recover(self, namespaces: list[Namespace], layout: SlotLayout) -> int:
        """Adopt the chunks every rank has on disk, in the same slot, oldest first."""
        per_rank = [read_disk_index(list(self.config.disk_paths), ns, layout)
                    for ns in namespaces]
        common = [(key, slot, header) for key, (slot, header) in per_rank[0].items()
                  if all(other.get(key, (None,))[0] == slot for other in per_rank[1:])]
        index = self.stack.indexes[DISK]
        for key, slot, _ in sorted(common, key=lambda item: item[2].generation):
            index.adopt(key, slot)
        log.info("kvtier: %d chunks found on disk", len(index))
        return len(index)

    # -- keys ---------------------------------------------------------------------------

    def chunk_keys(self, request: Any, count: int, first: int = 0) -> list[ChunkKey]:
        """Keys of the request's chunks ``first`` to ``count - 1`` (fewer if its tokens run
        out)."""
        per = self.geometry.hashes_per_chunk
        hashes = request.block_hashes
        count = min(len(hashes) // per, count)
        return [block_hash_chunk_key(self._namespace, hashes[(c + 1) * per - 1])
                for c in range(first, count)]

    def track(self, request: Any) -> _Tracked:
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        tracked.request = request
        return tracked

    def request(self, req_id: str) -> Any | None:
        tracked = self._tracked.get(req_id)
        return tracked.request if tracked is not None else None

    def load_tiers(self, req_id: str, tokens: int) -> dict[TierName, int]:
        """Tokens of a planned load by the tier they come from."""
        load = self._loads.get(req_id)
        if load is None or not load.tiers:
            return {}
        disk = min(tokens, load.tiers.get(DISK, 0) * self.geometry.chunk_tokens)
        return {DISK: disk, HOST: tokens - disk}

    # -- loads --------------------------------------------------------------------------

    def num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed`` (whole blocks, never the last token).

        None (ask again next step) while one of them is being read from disk for another
        request (it will then be in host memory), or while host slots to stage them in are
        held by loads and stores in flight (see ``_wait_for_room``)."""
        tracked = self.track(request)
        if request.request_id in self._loads:
            return 0, False
        block, chunk = self.geometry.block_tokens, self.geometry.chunk_tokens
        limit = (request.num_tokens - 1) // block * block  # vLLM computes at least one token
        keys = self.chunk_keys(request, -(-limit // chunk))
        match = self.stack.match_prefix(keys)
        hit = min(match.num_chunks * self.geometry.chunk_tokens, limit)
        wanted = hit - num_computed
        if wanted <= 0:
            return 0, False
        first = num_computed // chunk
        matched = match.locations[first:]
        loadable = self._loadable(keys[first:match.num_chunks], matched)
        if loadable is None:
            return None, False
        if loadable < len(matched) and self._wait_for_room(tracked, matched, wanted):
            return None, False
        tracked.waiting_since = None
        needed = matched[:loadable]
        wanted = min(hit, (first + len(needed)) * chunk) - num_computed
        if wanted <= 0:
            self.counters["load_cut_chunks"] += len(matched) - loadable
            return 0, False
        from_disk = sum(1 for loc in needed if loc.tier is DISK)
        if not self.decider.should_load(wanted, *self._load_bytes(needed)):
            return 0, False
        self.counters["load_cut_chunks"] += len(matched) - loadable
        # From host memory the copy is quick: done before this step's forward. From disk the
        # request waits (asynchronously) while other requests go on.
        tracked.asynchronous = from_disk > 0
        return wanted, from_disk > 0

    def _wait_for_room(self, tracked: _Tracked, matched: Sequence[Location], wanted: int) -> bool:
        """Whether a request whose hits do not all fit in the host slots free now should ask
        again next step rather than recompute the rest: the slots are held by loads and
        stores in flight, which give them back within a step or two. Not when the hits could
        not fit even then (host memory too small, or slots held by reads a hung disk has not
        answered), when loading them would not pay (``load_policy``), or once the request has
        waited ``staging_wait``."""
        limit = self.config.staging_wait
        if limit is None or len(matched) > self.stack.indexes[HOST].num_slots - len(self._stalled_plans):
            return False
        now = time.monotonic()
        if tracked.waiting_since is None:
            tracked.waiting_since = now
        if now - tracked.waiting_since >= limit:
            return False
        if not self.decider.would_load(wanted, *self._load_bytes(matched)):
            return False
        self.counters["room_waits"] += 1
        return True

    def _load_bytes(self, locations: Sequence[Location]) -> tuple[int, int]:
        """(bytes read from disk, bytes in all) to load the chunks at ``locations``."""
        chunk_bytes = self.geometry.chunk_bytes
        return sum(chunk_bytes for loc in locations if loc.tier is DISK), len(locations) * chunk_bytes

    def _loadable(self, keys: list[ChunkKey], locations: Sequence[Location]) -> int | None:
        """How many of the matched chunks (in order) can load now: each holds a host slot
        while it loads (a disk read needs one to stage in; a host chunk not yet pinned takes
        one out of reach when this load pins it). None when one of them is being staged
        into host memory by another load."""
        host = self.stack.indexes[HOST]
        room = host.reusable_slots
        for n, (key, loc) in enumerate(zip(keys, locations, strict=True)):
            if loc.tier is DISK and host.has_entry(key):
                return None
            cost = 0 if loc.tier is HOST and host.pinned(key) else 1
            if cost > room:
                return n
            room -= cost
        return len(locations)

    def plan_load(self, request: Any, block_ids: list[int], num_computed: int,
                  num_external: int) -> None:
        """Pin the chunks covering ``[num_computed, num_computed + num_external)`` and queue
        their load into the request's GPU blocks."""
        geo = self.geometry
        start, end = num_computed, num_computed + num_external
        keys = self.chunk_keys(request, -(-end // geo.chunk_tokens))
        tracked = self.track(request)
        load = _Load([], [], num_external, {}, asynchronous=tracked.asynchronous)
        tracked.asynchronous = False  # what the match promised is used up
        chunks: list[ChunkLoad] = []
        demotions: list[DiskWrite] = []
        for c in range(start // geo.chunk_tokens, -(-end // geo.chunk_tokens)):
            first = max(start, c * geo.chunk_tokens) // geo.block_tokens - c * geo.blocks_per_chunk
            last = min(end, (c + 1) * geo.chunk_tokens) // geo.block_tokens - c * geo.blocks_per_chunk
            ids = tuple(block_ids[c * geo.blocks_per_chunk + first:c * geo.blocks_per_chunk + last])
            chunks.append(self._plan_chunk_load(keys[c] if c < len(keys) else None, ids, first,
                                                load, demotions))
        self._loads[request.request_id] = load
        self._new_loads.append(RequestLoad(request.request_id, tuple(chunks), tuple(demotions),
                                           load.asynchronous))

    def _plan_chunk_load(self, key: ChunkKey | None, ids: tuple[int, ...], first: int,
                         load: _Load, demotions: list[DiskWrite]) -> ChunkLoad:
        """One chunk of a load: pinned where it is, a disk chunk with a host slot to stage
        its read in. A chunk gone since the match, on disk in a synchronous load, or with no
        host slot free is not loaded, nor is any chunk after it: the workers report their
        blocks invalid and vLLM recomputes them (the chunks stay cached)."""
        location = self.stack.locate(key) if key is not None and not load.cut else None
        plan = None
        if key is not None and location is not None and location.tier is DISK:
            self.stack.indexes[DISK].pin(key)
            plan = self.stack.plan_store(key, HOST) if load.asynchronous else None
            if plan is None:
                self.stack.unpin(key, location)
                location = None
        if key is None or location is None:
            load.cut = True
            self.counters["load_skipped_chunks"] += 1
            return ChunkLoad(key or b"", ids, first, None)
        load.pinned.append((key, location))
        load.tiers[location.tier] = load.tiers.get(location.tier, 0) + 1
        self.counters[f"load_chunks_{location.tier}"] += 1
        if location.tier is HOST:
            self.stack.indexes[HOST].pin(key)
            return ChunkLoad(key, ids, first, location.slot)
        assert plan is not None, "a disk chunk loads through a host staging slot"
        demotions += self._demotion_writes(plan.demotions)
        load.staged.append(plan)
        return ChunkLoad(key, ids, first, plan.dst.slot, location.slot)

    def _demotion_writes(self, moves: tuple[Move, ...]) -> list[DiskWrite]:
        """Host victims that must reach disk before their slot is reused (write-back)."""
        writes = []
        for move in moves:
            assert move.src.tier is HOST and move.dst.tier is DISK, move
            writes.append(DiskWrite(move.key, move.src.slot, move.dst.slot))
            self._pending.disk[move.key] = (move.dst, None)
        return writes

    def finish_load(self, req_id: str) -> None:
        """The workers finished loading ``req_id``: keep what arrived, drop what failed."""
        failed = self._load_failures.pop(req_id, set())
        load = self._loads.pop(req_id, None)
        if load is None:
            return
        for plan in load.staged:
            ok = plan.key not in failed
            if not ok and self._stalled_ranks[plan.key] > 0:
                self._stalled_plans[plan.key] = plan  # a read may still be filling the slot
                continue
            self.stack.finish(plan.key, plan.dst, ok)
        for key, location in load.pinned:
            self.stack.unpin(key, location)
            if key in failed:
                self.stack.discard(key)
                self.counters["load_failed_chunks"] += 1

    # -- stores -------------------------------------------------------------------------

    def completes_chunks(self, req_id: str, num_computed_after: int) -> bool:
        """Whether the request has chunks computed and not yet offered for store."""
        tracked = self._tracked.get(req_id)
        stored = tracked.stored_upto if tracked is not None else 0
        return num_computed_after // self.geometry.chunk_tokens > stored

    def plan_stores(self, request: Any, block_ids: list[int], num_computed_after: int,
                    meta: StepPlan) -> None:
        """Offer, in order, every chunk of ``request`` that is fully computed after this step.

        A chunk that finds no free host slot (all held by stores and loads in flight) stops
        the offer there; the request's next step offers it again, while its blocks are
        still the request's own."""
        tracked = self.track(request)
        geo = self.geometry
        first = tracked.stored_upto  # a decode step usually completes none
        keys = self.chunk_keys(request, num_computed_after // geo.chunk_tokens, first)
        for c, key in enumerate(keys, start=first):
            ids = block_ids[c * geo.blocks_per_chunk:(c + 1) * geo.blocks_per_chunk]
            if len(ids) < geo.blocks_per_chunk or not self._plan_store(key, tuple(ids), meta):
                break
            tracked.stored_upto = c + 1

    def _plan_store(self, key: ChunkKey, ids: tuple[int, ...], meta: StepPlan) -> bool:
        """Plan one chunk's store; False when no host slot is free for it now."""
        if self.stack.locate(key) is not None or self.stack.indexes[HOST].has_entry(key):
            self.stack.touch(key)
            return True
        plan = self.stack.plan_store(key, HOST)
        if plan is None:
            return False
        meta.demotions += self._demotion_writes(plan.demotions)
        disk = None
        if (DISK in self.stack.indexes and self.config.write_policy is WritePolicy.WRITE_THROUGH
                and not self.stack.indexes[DISK].has_entry(key)):
            disk_plan = self.stack.plan_store(key, DISK)
            disk = disk_plan.dst if disk_plan is not None else None
        self._pending.host[key] = (plan.dst, disk)
        if disk is not None:
            self._pending.disk[key] = (disk, plan.dst)
        meta.stores.append(ChunkStore(key, ids, plan.dst.slot, disk.slot if disk else None))
        return True

    # -- outcomes -----------------------------------------------------------------------

    def worker_report(self, report: WorkerReport) -> None:
        """Apply the workers' outcomes: a chunk counts as stored when every rank stored it."""
        for disk_bytes, host_bytes, seconds in report.load_samples:
            self.decider.observe_load(disk_bytes, host_bytes, seconds)
        for req_id, keys in report.load_failed.items():
            self._load_failures.setdefault(req_id, set()).update(keys)
        for key, ranks in report.reads_stalled.items():
            self._stalled_ranks.up(key, ranks)
        for req_id, ranks in report.loads_done.items():
            if self._loads_done.reached(req_id, ranks, self.world_size):
                self.finish_load(req_id)
        for key in set(report.host_stored) | set(report.host_failed):
            if key not in self._pending.host:
                continue
            ok = self._host_outcomes.add(key, report.host_stored[key], report.host_failed[key])
            if ok is None:
                continue
            dst, disk = self._pending.host.pop(key)
            self.stack.finish(key, dst, ok)
            self.counters["stored_chunks" if ok else "store_failed_chunks"] += 1
            if disk is not None and key in self._pending.disk:
                if ok:
                    self.stack.indexes[HOST].pin(key)  # until its disk write is over
                else:
                    self._pending.disk.pop(key)
                    self.stack.finish(key, disk, False)
        for key in set(report.disk_written) | set(report.disk_failed):
            if key not in self._pending.disk:
                continue
            ok = self._disk_outcomes.add(key, report.disk_written[key], report.disk_failed[key])
            if ok is None:
                continue
            dst, host = self._pending.disk.pop(key)
            self.stack.finish(key, dst, ok)
            self.counters["disk_written_chunks" if ok else "disk_failed_chunks"] += 1
            if host is not None:
                self.stack.unpin(key, host)
        for key, ranks in report.reads_over.items():
            if self._stalled_ranks.down(key, ranks):
                plan = self._stalled_plans.pop(key, None)
                if plan is not None:
                    self.stack.finish(plan.key, plan.dst, False)
        if self.disk_layout is not None:
            self._paths_changed(report, self.disk_layout)

    def _paths_changed(self, report: WorkerReport, layout: SlotLayout) -> None:
        """A disk path's slots leave the index when a rank takes it out of service, and
        come back (empty) when every rank that did has it back."""
        index = self.stack.indexes[DISK]
        for path, ranks in report.paths_down.items():
            if self._ranks_down.up(path, ranks):
                index.retire(range(path, layout.num_slots, layout.num_paths))
        for path, ranks in report.paths_up.items():
            if self._ranks_down.down(path, ranks):
                index.unretire(range(path, layout.num_slots, layout.num_paths))

    def metric_samples(self) -> list:
        """The scheduler side's metrics (served on ``metrics_port``)."""
        from kvtier.metrics import Sample

        loaded = Sample("chunks_loaded_total", "counter", "Chunks loaded, by the tier they came from")
        evictions = Sample("evictions_total", "counter", "Chunks evicted, by tier")
        slots = Sample("slots", "gauge", "Chunk slots, by tier")
        used = Sample("used_slots", "gauge", "Chunk slots holding a chunk, by tier")
        for tier, index in self.stack.indexes.items():
            loaded.add(self.counters[f"load_chunks_{tier}"], tier=str(tier))
            evictions.add(index.evictions, tier=str(tier))
            slots.add(index.num_slots, tier=str(tier))
            used.add(len(index), tier=str(tier))
        plain = [("chunks_stored_total", "Chunks stored in host memory", "stored_chunks"),
                 ("chunks_written_total", "Chunks written to disk", "disk_written_chunks"),
                 ("store_failures_total", "Chunks that failed to store", "store_failed_chunks"),
                 ("disk_write_failures_total", "Chunks that failed to reach disk", "disk_failed_chunks"),
                 ("load_failures_total", "Chunks that failed to load (recomputed)",
                  "load_failed_chunks"),
                 ("load_cut_chunks_total", "Hits recomputed for want of a free host slot to "
                  "stage them in (host_capacity too small for the loads running at once)",
                  "load_cut_chunks"),
                 ("room_waits_total", "Times a request was asked to come back next step "
                  "while host slots to stage its hits in were in use", "room_waits")]
        return [loaded, evictions, slots, used,
                *(Sample(name, "counter", text).add(self.counters[key]) for name, text, key in plain),
                Sample("loads_skipped_total", "counter", "Hits not loaded: recomputing was "
                       "faster (load_policy auto)").add(self.decider.skipped),
                Sample("drops_total", "counter", "Chunks evicted from the last tier").add(
                    self.stack.drops)]

    def build_meta(self, meta: StepPlan | None = None) -> StepPlan:
        """This step's plan, in ``meta`` when given (vLLM's subclass); stores are added to it
        by ``plan_stores``."""
        meta = StepPlan() if meta is None else meta
        meta.loads, self._new_loads = self._new_loads, []
        return meta

    def request_finished(self, req_id: str) -> bool:
        """True while an asynchronous load into the request's blocks is still running (a
        load from host memory is over before the request's first forward)."""
        self._tracked.pop(req_id, None)
        load = self._loads.get(req_id)
        return load is not None and load.asynchronous
