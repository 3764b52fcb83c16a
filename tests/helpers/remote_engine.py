"""A connector engine without vLLM on a remote store: a scheduler side and one worker over a
synthetic paged cache, stepped by hand."""

import time

import torch

from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import StepPlan
from kvtier.connector.scheduler.handoff import Role
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.worker.side import WorkerSide
from tests.helpers.scheduler_side import BLOCK, CHUNK, GEO
from tests.helpers.worker_side import BLOCKS


class Engine:
    """A scheduler side and one worker over a synthetic paged cache (of ``geo``), stepped
    by hand; with ``events`` (an event factory) and ``hashing`` (vLLM's) its KV events."""

    def __init__(self, server, geo: KVGeometry = GEO, role: Role = Role.BOTH, events=None,
                 hashing=None, **extra) -> None:
        cfg = load_config({"chunk_tokens": CHUNK, "host_capacity": 8 * geo.chunk_bytes,
                           "load_policy": "always", "remote_url": server.url,
                           "remote_timeout": "1s", "remote_retry": "300ms", "io_threads": 2,
                           **extra}, environ={})
        self.ns = geo.namespace("m", "", 1, 0)
        self.scheduler = SchedulerSide(cfg, geo, [self.ns], 1, events, role=role, hashing=hashing)
        self.worker = WorkerSide(cfg, geo, self.ns)
        shape = (geo.num_layers, BLOCKS, 2, BLOCK, geo.page_bytes // (2 * BLOCK * 2))
        self.kv = list(torch.randn(*shape).to(torch.bfloat16).unbind(0))
        self.worker.register({f"layer{i}": t for i, t in enumerate(self.kv)})

    def step(self, meta: StepPlan | None = None) -> None:
        """One step: the plan to the worker, the worker's report back."""
        meta = self.scheduler.build_meta(meta)
        self.worker.start_loads(meta)
        self.worker.save(meta)
        self.worker.drain(10)
        self.worker.finished()
        report = self.worker.report()
        if report is not None:
            self.scheduler.worker_report(report)

    def store(self, req, blocks) -> None:
        meta = StepPlan()
        self.scheduler.plan_stores(req, (blocks,), req.num_tokens, meta)
        self.step(meta)
        self.step()  # the remote writes of the chunks stored, planned from the report
        self.step()  # their outcomes

    def pages(self, blocks) -> list[torch.Tensor]:
        return [t[blocks].clone() for t in self.kv]

    def match(self, req, timeout: float = 10.0) -> tuple[int | None, bool]:
        deadline = time.monotonic() + timeout
        while True:
            answer = self.scheduler.num_new_matched_tokens(req, 0)
            if answer[0] is not None or time.monotonic() > deadline:
                return answer
            time.sleep(0.01)

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()
