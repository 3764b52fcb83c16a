"""The connector's scheduler side: all of kvtier's bookkeeping for a vLLM engine.

It lives in the engine-core process, next to vLLM's scheduler, and never touches bytes: it
decides which chunks to load and store, in which host and disk slots, and tells the workers
through ``StepPlan``; the workers report outcomes back through ``WorkerReport``.
Every reservation is two-phase: a chunk becomes visible only after all ranks reported it
stored; chunks being loaded stay pinned until the load is over.

``SchedulerSide`` is the face vLLM's calls reach; ``LoadPlanner`` (loads), ``StorePlanner``
(stores) and ``Outcomes`` (the workers' reports) work over the records of ``records``."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from kvtier.config.settings import KVTierConfig, LoadPolicy
from kvtier.connector.common.engine_writer import EngineSegments, engine_writers
from kvtier.connector.common.geometry import KVGeometry, say_unstored_replies
from kvtier.connector.common.messages import GroupBlocks, StepPlan, WorkerReport
from kvtier.connector.scheduler.chunk_records import ChunkHashing
from kvtier.connector.scheduler.decider import LoadDecider
from kvtier.connector.scheduler.disk_recovery import disk_layout, recover_disk
from kvtier.connector.scheduler.event_feed import event_feed
from kvtier.connector.scheduler.events import EventFactory, KVEvents
from kvtier.connector.scheduler.handoff import Handoffs, Role, has_pool
from kvtier.connector.scheduler.load_planner import LoadPlanner
from kvtier.connector.scheduler.metrics import metric_samples
from kvtier.connector.scheduler.outcomes import Outcomes
from kvtier.connector.scheduler.paths_back import paths_back
from kvtier.connector.scheduler.pool_writes import PoolWrites, pool_write_tries
from kvtier.connector.scheduler.records import AbortedStores, PendingStores, StalledReads, Tracked
from kvtier.connector.scheduler.remote_audit import remote_writes
from kvtier.connector.scheduler.remote_presence import open_presence
from kvtier.connector.scheduler.request_keys import RequestKeys
from kvtier.connector.scheduler.store_planner import StorePlanner
from kvtier.connector.scheduler.tails import Tail, prompt_length
from kvtier.connector.scheduler.tier_watch import tier_stack
from kvtier.connector.scheduler.verify_halt import VerifyHalt
from kvtier.connector.scheduler.verify_planner import VerifyPlanner
from kvtier.keys import ChunkKey, Namespace
from kvtier.segment.halt_file import HaltFile
from kvtier.shared.follower import follow_others
from kvtier.tiers.base import TierName

log = logging.getLogger("kvtier")


class SchedulerSide:
    """Bookkeeping for one engine (all TP ranks share one index; each rank keeps its own
    shard of every chunk in the same slots, under its own namespace).

    Public state: ``stack`` (the tiers' indexes), ``decider`` (``load_policy``),
    ``counters`` (chunks loaded by tier, stored, written, failed), ``recovered`` (chunks
    found on disk at start), ``disk_layout`` (None without disk paths), ``events`` (the KV
    events of its tiers, made by ``event_factory``; None while vLLM's are off). With
    ``hashing`` (vLLM's), each chunk written to disk keeps a token record in its header."""

    def __init__(self, config: KVTierConfig, geometry: KVGeometry, namespaces: list[Namespace],
                 world_size: int, event_factory: EventFactory | None = None,
                 role: Role = Role.BOTH, hashing: ChunkHashing | None = None) -> None:
        self.config, self.geometry, self.world_size = config, geometry, world_size
        self.disk_layout = disk_layout(config, geometry)
        self.writers = engine_writers(config, namespaces)  # each rank's segment
        self.counters: Counter = Counter()
        self.events = KVEvents(geometry, event_factory, self.counters) if event_factory else None
        self.stack = tier_stack(config, geometry, self.disk_layout, self.events)
        self.decider = LoadDecider(config.load_policy is LoadPolicy.AUTO)
        self.handoffs = Handoffs(role, namespaces[0], config.load_timeout, self.counters, has_pool(config))
        self.keys = RequestKeys(geometry, namespaces[0], self.handoffs.epoch_of)
        self._tracked: dict[str, Tracked] = {}  # req id -> what is kept of it
        pending, stalled, aborted = PendingStores(), StalledReads(), AbortedStores(self.stack)
        self.recovered = recover_disk(config, namespaces, self.writers, self.disk_layout, self.stack)
        say_unstored_replies(geometry)
        self.others = follow_others(config, namespaces, geometry.chunk_bytes,
                                    EngineSegments(config, namespaces))
        self.presence = open_presence(config, namespaces, geometry.chunk_bytes)
        self.feed = event_feed(self.events, self.stack, (self.others, self.presence),
                               config.disk_paths, namespaces[0], self.writers[0],
                               self.disk_layout, geometry, hashing, self.counters)
        self.remote_writes, self._audit = remote_writes(self.presence, self.stack, self.counters,
                                                        world_size, config, geometry.chunk_bytes,
                                                        pool_write_tries(role))
        self._loads = LoadPlanner(config, geometry, self.stack, self.decider, self.counters, pending,
                                  stalled, self.others, self.presence, self.remote_writes)
        self.halt = VerifyHalt(config.verify_halt_after, self.counters, HaltFile(
            config.disk_paths[0], namespaces[0].id) if self.disk_layout else None, config.load_timeout)
        self.verify = VerifyPlanner(config, self.stack, self.counters, world_size, pending, stalled,
                                    self.others, self.presence, self.remote_writes, self.halt, aborted)
        self._stores = StorePlanner(config, geometry, self.stack, pending, self.remote_writes,
                                    self.events, self.verify, hashing)
        self._loads.records = self._stores.record if self.remote_writes is not None else None
        self._pool = PoolWrites(config, role, self.stack, pending, self.remote_writes,
                                geometry.chunk_tokens, self.counters, self.others)
        paths = paths_back(world_size, self.stack, self.disk_layout, self.feed)
        self._outcomes = Outcomes(world_size, self.stack, self.counters, self._loads,
                                  self.decider, pending, stalled, paths,
                                  self.remote_writes, self.verify, self._pool.rewrites, aborted)

    # -- keys ---------------------------------------------------------------------------

    def chunk_keys(self, request: Any, count: int, first: int = 0) -> list[ChunkKey]:
        """Keys of the request's chunks ``first`` to ``count - 1`` (``RequestKeys``)."""
        return self.keys.chunk_keys(self.track(request), count, first)

    def tail(self, request: Any) -> Tail | None:
        """The request's prompt tail (its partial last chunk: ``RequestKeys``)."""
        return self.keys.tail(self.track(request))

    def _keys(self, request: Any, end: int) -> tuple[list[ChunkKey], int]:
        return self.keys.keys(self.track(request), end)

    def track(self, request: Any) -> Tracked:
        tracked = self._tracked.setdefault(request.request_id, Tracked(request))
        tracked.request = request
        return tracked

    def request(self, req_id: str) -> Any | None:
        tracked = self._tracked.get(req_id)
        return tracked.request if tracked is not None else None

    def load_tiers(self, req_id: str, tokens: int) -> dict[TierName, int]:
        """Tokens of a planned load by the tier they come from."""
        return self._loads.tiers(req_id, tokens)

    # -- loads --------------------------------------------------------------------------

    def num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed``: all but the last token of the request
        (vLLM computes at least one), its prompt's tail included; whole blocks for models
        without tails (``tails.prompt_tail``).

        None (ask again next step) while one of them is being read from disk for another
        request (it will then be in host memory), or while host slots to stage them in are
        held by loads and stores in flight (see ``LoadPlanner.match``)."""
        tracked = self.track(request)
        if self._loads.in_flight(request.request_id) is not None or not self.keys.keyable(tracked):
            return (None if self.keys.pending(tracked) else 0), False  # adapter: being read
        limit = request.num_tokens - 1
        if self.geometry.loads_whole or prompt_length(request) is None:
            limit = limit // self.geometry.block_tokens * self.geometry.block_tokens
        keys, limit = self._keys(request, limit)
        found, load_async = self._loads.match(tracked, keys, limit, num_computed)
        chunk, computed = self.geometry.chunk_tokens, -(-num_computed // self.geometry.chunk_tokens)
        self.verify.held(tracked, computed)  # sampled: what vLLM holds by now is never checked
        if found and (self.halt.halted or self.verify.sample(tracked, keys, computed)):
            tracked.asynchronous = False  # a miss at once: no hand-off is waited for
            return 0, False
        tail = self.tail(request)  # full chunks reach ``limit`` when they cover it
        reach = limit if tail is not None and keys[-1:] == [tail.key] else \
            min(limit, request.num_tokens // chunk * chunk)
        return self.handoffs.match(request, found, tracked.visible, reach, num_computed,
                                   self._look_again), load_async

    def _look_again(self, req_id: str) -> None:
        """A request waits for a hand-off: the pool is looked at anew (soon, off the step)."""
        if self.presence is not None:
            self.presence.forget(req_id)
        if self.others is not None:
            self.others.refresh_soon()

    def plan_load(self, request: Any, block_ids: GroupBlocks, num_computed: int,
                  num_external: int) -> None:
        """Pin the chunks covering ``[num_computed, num_computed + num_external)`` and queue
        their load into the request's GPU blocks (``block_ids``: per KV cache group)."""
        keys, _ = self._keys(request, num_computed + num_external)
        self._loads.plan(request.request_id, self.track(request), keys, block_ids, num_computed,
                         num_external)

    def finish_load(self, req_id: str) -> None:
        """The workers finished loading ``req_id``: keep what arrived, drop what failed."""
        self._loads.finish(req_id)

    # -- stores -------------------------------------------------------------------------

    def completes_chunks(self, req_id: str, num_computed_after: int) -> bool:
        """Whether the request has chunks computed and not yet offered for store (on a
        consumer, which stores nothing: for a sampled check)."""
        tracked = self._tracked.get(req_id)
        if tracked is not None and (tracked.store_done or not self.keys.keyable(tracked)):
            return False
        if not self.handoffs.stores and (tracked is None or not tracked.verify):
            return False
        stored = tracked.stored_upto if tracked is not None else 0
        if num_computed_after // self.geometry.chunk_tokens > stored:
            return True
        return tracked is not None and self._tail_due(tracked, num_computed_after)

    def _tail_due(self, tracked: Tracked, num_computed_after: int) -> bool:
        """Whether the request's prompt tail is computed and not offered yet (its chunks were)."""
        tail = self.tail(tracked.request)  # first: a prompt that grew has a new tail to offer
        if tracked.tail_done:
            return False
        if tail is None:
            tracked.tail_done = True
            return False
        return num_computed_after >= tail.end and tracked.stored_upto >= tail.index

    def plan_stores(self, request: Any, block_ids: GroupBlocks, num_computed_after: int,
                    meta: StepPlan) -> None:
        """Offer, in order, every chunk of ``request`` that is fully computed after this step
        (``block_ids``: the request's blocks per KV cache group), then its prompt's tail once
        the prompt is computed.

        A chunk that finds no free host slot (all held by stores and loads in flight) stops
        the offer there; the request's next step offers it again, while its blocks are
        still the request's own."""
        tracked = self.track(request)
        tracked.computed = max(tracked.computed, num_computed_after)
        count = num_computed_after // self.geometry.chunk_tokens
        keys = self.chunk_keys(request, count, tracked.stored_upto)  # a decode step: none
        self._stores.plan(tracked, keys, block_ids, meta, stores=self.handoffs.stores)
        if self._tail_due(tracked, num_computed_after):
            tail = self.tail(request)
            assert tail is not None
            self._stores.plan_tail(tracked, tail, block_ids, meta, stores=self.handoffs.stores)

    # -- outcomes -----------------------------------------------------------------------

    def worker_report(self, report: WorkerReport) -> None:
        """Apply the workers' outcomes: a chunk counts as stored when every rank stored it."""
        self._outcomes.apply(report)

    def close(self) -> None:
        """Stop following other engines' segments, the halt file, asking the remote store."""
        self.halt.close()
        self.keys.adapters.close()
        for part in (self.feed, self.others, self.presence):
            if part is not None:
                part.close()

    def take_events(self) -> list:
        """The KV events of this engine's tiers since the last call (vLLM's ``take_events``)."""
        return [] if self.feed is None else self.feed.take()

    def metric_samples(self) -> list:
        """The scheduler side's metrics (served on ``metrics_port``)."""
        return metric_samples(self.stack, self.counters, self.decider, self.presence,
                              self.others, self._outcomes.payoff)

    def build_meta(self, meta: StepPlan | None = None) -> StepPlan:
        """This step's plan, in ``meta`` when given (vLLM's subclass); stores are added to it
        by ``plan_stores``. Called once per scheduler step, after its lookups."""
        meta = StepPlan() if meta is None else meta
        if self.presence is not None:  # this step's lookups are over: the next one's start
            self.presence.next_step()
        if self._audit is not None:  # before the writes are taken: lost host chunks go again
            self._audit.tick()
        self._outcomes.step()  # a disk path back: a few of its chunks adopted a step
        meta.loads = self._loads.take_new()
        meta.rewrites = self._pool.rewrites.take_new()  # a producer's failed disk writes
        if self.remote_writes is not None:
            meta.remote_writes = self.remote_writes.take_new()
        return meta

    def handoff_params(self, request: Any) -> dict | None:
        """What a finishing request hands vLLM (``Handoffs.params``): a producer's hand-off of
        its prompt's leading tokens the pool holds or is being written (``PoolWrites``)."""
        tracked = self._tracked.get(request.request_id)
        stored = self._pool.tokens(tracked, self.chunk_keys(request, tracked.stored_upto)) \
            if tracked else 0
        return self.handoffs.params(request, stored, tracked.epoch if tracked else None)

    def reset_cache(self, router_told: bool = True) -> bool:
        """vLLM's cache reset (``reset_connector``: new weights loaded in place, a paused engine's
        caches cleared): nothing stored before, in any tier or pool, is loaded again. Keys are
        in a new epoch from now on (``Handoffs.reset``); a request tracked now neither loads nor
        stores (``RequestKeys.unkey``); the KV events forget what they told, its removal told
        unless ``router_told`` (``EventFeed.reset``). Chunks of before stay till evicted."""
        self.handoffs.reset()
        for tracked in self._tracked.values():
            self.keys.unkey(tracked)
        if self.feed is not None:
            self.feed.reset(router_told)
        self.counters["cache_resets"] += 1
        log.warning("kvtier: cache reset (vLLM's reset_connector): nothing cached before loads")
        return True

    def has_pending_push_work(self) -> bool:
        """Whether vLLM should step this engine with no request: a producer's pool writes out
        after a hand-off (``PoolWrites.pushing``), a disk path back's chunks to adopt, or
        chunks to tell a router again (``KVEvents.retelling``)."""
        retelling = self.events is not None and self.events.retelling
        return self._pool.pushing() or self._outcomes.adopting() or retelling

    def request_finished(self, req_id: str) -> bool:
        """True while an asynchronous load into the request's blocks is still running (a
        load from host memory is over before the request's first forward). Chunks it
        computed and never stored, for want of a free host slot, are counted."""
        tracked = self._tracked.pop(req_id, None)
        if tracked is not None and self.handoffs.stores and self.keys.keyable(tracked):
            self.counters["store_no_room_chunks"] += self._stores.unstored(
                tracked, tracked.computed, self.keys.tail(tracked))
        self.handoffs.forget(req_id)
        if self.presence is not None:
            self.presence.forget(req_id)
        load = self._loads.in_flight(req_id)
        return load is not None and load.asynchronous

