"""``KVTierConnector``: the thin vLLM adapter, routing each call to the side that owns it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.config.settings import KVTierConfig, load_config
from kvtier.connector.common.geometry import geometry_from_vllm
from kvtier.connector.common.messages import StepPlan, WorkerReport
from kvtier.connector.common.model_settings import settings_digest
from kvtier.connector.scheduler.handoff import Role, fit_role
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.vllm_events import GpuClears, VllmHashing, event_factory
from kvtier.connector.worker.counters import WorkerCounters
from kvtier.connector.worker.side import WorkerSide
from kvtier.errors import ConfigError
from kvtier.logs import apply_log_level
from kvtier.metrics import serve_metrics
from kvtier.tiers.base import TierName

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput

log = logging.getLogger("kvtier")


@dataclass
class KVTierMetadata(StepPlan, KVConnectorMetadata):
    """A step's plan (``StepPlan``) as vLLM's connector metadata."""


@dataclass
class KVTierWorkerMeta(WorkerReport, KVConnectorWorkerMetadata):
    """A worker's report (``WorkerReport``) as vLLM's worker metadata."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMeta:
        assert isinstance(other, KVTierWorkerMeta)
        return self.merged(other)


@dataclass
class KVTierStats(WorkerCounters, KVConnectorStats):
    """A worker's counters (``WorkerCounters``) as vLLM's connector statistics."""

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        self.merge(other)
        return self


MAX_PORT = 65535


def metrics_base(config: KVTierConfig, tp: int, dp: int = 0) -> int:
    """The scheduler side's metrics port (0: none): an engine of (local) DP rank ``dp``
    serves from ``metrics_port + dp * (1 + tp)``, its scheduler side there and the worker of
    TP rank r on that plus 1 + r; ``ConfigError`` unless every one is a TCP port."""
    port = config.metrics_port
    base = port + dp * (1 + tp) if port else 0
    if base + tp > MAX_PORT:
        raise ConfigError(
            f"kvtier config: bad value {port} for 'metrics_port' "
            f"({config.sources.get('metrics_port', 'default')}): the worker of TP rank r of DP "
            f"rank d serves on metrics_port + d * (1 + TP) + 1 + r, up to {base + tp} for {tp} "
            f"TP ranks at DP rank {dp}, above {MAX_PORT}; allowed: a TCP port 1-"
            f"{MAX_PORT - tp - dp * (1 + tp)}, or 0, off or none for no metrics endpoint")
    return base


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """Tiered KV offload (host memory, then disk) for vLLM; see docs/vllm.md.

    Serves hybrid models with vLLM's hybrid KV cache manager on (``SupportsHMA``): a chunk
    holds every KV cache group's pages (see ``geometry``)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        kv_role = Role.of(getattr(self._kv_transfer_config, "kv_role", None))
        self.config = fit_role(kv_role, load_config(extra))
        apply_log_level()
        parallel = vllm_config.parallel_config
        tp, dp = parallel.tensor_parallel_size, parallel.data_parallel_rank_local
        port = metrics_base(self.config, tp, parallel.data_parallel_rank if dp is None else dp)
        self.geometry = geometry_from_vllm(vllm_config, kv_cache_config, self.config)
        model = vllm_config.model_config
        settings = settings_digest(vllm_config, kv_cache_config)
        namespaces = [self.geometry.namespace(str(model.model), str(model.revision or ""), tp, r,
                                              settings) for r in range(tp)]
        self._local_computed: dict[str, int] = {}
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._metrics = None
        self._clears: GpuClears | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._recompute_failed_loads()
            block = self.geometry.block_tokens
            self._scheduler = SchedulerSide(
                self.config, self.geometry, namespaces, tp,
                event_factory(vllm_config, kv_cache_config, block), kv_role,
                VllmHashing(vllm_config, block))
            self._clears = GpuClears() if self._scheduler.events is not None else None
            if port:
                self._metrics = serve_metrics(port, self._scheduler.metric_samples,
                                              self.config.metrics_host)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            self._worker = WorkerSide(self.config, self.geometry, namespaces[rank],
                                      leader=namespaces[0])
            if port:
                self._metrics = serve_metrics(port + 1 + rank, self._worker.metric_samples,
                                              self.config.metrics_host)

    def _recompute_failed_loads(self) -> None:
        """A chunk that fails to load is a cache miss: vLLM must recompute it, not fail the
        request (vLLM's default policy for connectors, read right after this constructor)."""
        transfer = self._kv_transfer_config
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            log.info("kvtier: setting kv_load_failure_policy to 'recompute' (a failed load "
                     "is a cache miss)")
            transfer.kv_load_failure_policy = "recompute"

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    @property
    def _worker_side(self) -> WorkerSide:
        assert self._worker is not None, "a worker call on the scheduler's connector"
        return self._worker

    @property
    def _scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler call on a worker's connector"
        return self._scheduler

    # -- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker_side.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker_side.start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits until the whole load is over

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole pages are copied once the step is over, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker_side.save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker_side.finished() or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        finished = self._worker_side.finished()
        return KVConnectorTransferResults(finished_recving=finished,
                                          failed_recving=self._worker_side.take_failed_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side.take_invalid_blocks()

    def build_connector_worker_meta(self) -> KVTierWorkerMeta | None:
        report = self._worker_side.report()
        return None if report is None else KVTierWorkerMeta.of(report)

    def get_kv_connector_stats(self) -> KVTierStats | None:
        stats = self._worker.stats() if self._worker is not None else None
        return None if stats is None else KVTierStats(data=stats.data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats:
        return KVTierStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def _meta(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        return meta

    # -- scheduler side -----------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._scheduler_side.track(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   *args: Any) -> tuple[int | None, bool]:
        self._local_computed[request.request_id] = num_computed_tokens
        return self._scheduler_side.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens:
            self._scheduler_side.plan_load(request, blocks.get_block_ids(),
                                           self._local_computed.get(request.request_id, 0),
                                           num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        tiers = self._scheduler_side.load_tiers(request.request_id, num_external_tokens)
        names = {TierName.HOST: CacheHitSource.HOST, TierName.DISK: CacheHitSource.DISK,
                 TierName.REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED}
        return {names[tier]: tokens for tier, tokens in tiers.items() if tokens}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduler = self._scheduler_side
        self._look_for_clears()
        meta = KVTierMetadata()
        scheduler.build_meta(meta)
        scheduled = scheduler_output.num_scheduled_tokens
        new_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        prefill = sum(n for req_id, n in scheduled.items() if req_id in new_ids or n > 1)
        scheduler.decider.observe_step(sum(scheduled.values()), prefill)
        for req_id, tokens in scheduled.items():
            request = scheduler.request(req_id)
            if (request is None or self._kv_cache_manager is None
                    or not scheduler.completes_chunks(req_id, computed[req_id] + tokens)):
                continue  # most decode steps complete no chunk: nothing to look up
            block_ids = self._kv_cache_manager.get_block_ids(req_id)
            scheduler.plan_stores(request, block_ids, computed[req_id] + tokens, meta)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, KVTierWorkerMeta):
            self._scheduler_side.worker_report(report)

    def take_events(self) -> list[KVCacheEvent]:
        return self._scheduler.take_events() if self._scheduler is not None else []

    def has_pending_push_work(self) -> bool:
        # a producer's pool writes after a hand-off: their outcomes (and a failed one's
        # write again) come only with steps, so an idle engine keeps stepping a while
        if self._scheduler is None:
            return False
        self._look_for_clears()
        return self._scheduler.has_pending_push_work()

    def _look_for_clears(self) -> None:
        # vLLM's GPU cache cleared without kvtier's (a plain reset_prefix_cache): its
        # AllBlocksCleared, published before kvtier's events, makes a router forget kvtier's
        # chunks too, which are loaded still: they are told again (KVEvents.router_cleared)
        events = self._scheduler_side.events
        if events is not None and self._gpu_cleared():
            events.router_cleared()

    def _gpu_cleared(self) -> bool:
        """Whether vLLM's GPU cache was cleared since the last look (``GpuClears``)."""
        manager = self._kv_cache_manager
        return self._clears is not None and manager is not None \
            and self._clears.look(manager.block_pool)

    def reset_cache(self) -> bool | None:
        # vLLM's reset_connector (a weight update in place, a pause clearing the caches):
        # nothing stored before is loaded again (``SchedulerSide.reset_cache``). vLLM resets
        # the connector even when its own reset failed (blocks in use): no AllBlocksCleared
        # then, and the router is told the removal of kvtier's chunks instead
        if self._scheduler is None:
            return None
        return self._scheduler.reset_cache(self._clears is None or self._gpu_cleared())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._local_computed.pop(request.request_id, None)
        scheduler = self._scheduler_side  # a producer hands off what it stored (``handoff``)
        params = scheduler.handoff_params(request)  # before its records go
        return scheduler.request_finished(request.request_id), params

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])
