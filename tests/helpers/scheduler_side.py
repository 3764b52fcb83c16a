"""The connector's scheduler side driven directly: its geometry, stand-in requests, and
chunks stored as if every worker reported them."""

from collections import Counter
from dataclasses import dataclass, field

from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import StepPlan, WorkerReport
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.disk.tier import DiskTier
from kvtier.io.buffers import AlignedBuffer

BLOCK, CHUNK = 16, 32
GEO = KVGeometry(num_layers=2, page_bytes=4096, block_tokens=BLOCK, hash_block_tokens=BLOCK,
                 chunk_tokens=CHUNK, kv_dtype="bfloat16", page_shape="t")


@dataclass
class Request:
    request_id: str
    num_tokens: int
    block_hashes: list = field(default_factory=list)


def request(name: str, tokens: int, seed: int = 0) -> Request:
    return Request(name, tokens, [bytes([seed, i]) * 16 for i in range(tokens // BLOCK)])


def scheduler(world: int = 1, disk=None, disk_slots=8, geometry: KVGeometry = GEO,
              **extra) -> SchedulerSide:
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 4 * GEO.chunk_bytes, "load_policy": "always",
           **extra}
    if disk is not None:
        cfg.update(disk_paths=[str(disk)], disk_capacity=disk_slots * (4096 + GEO.chunk_bytes))
    namespaces = [geometry.namespace("m", "", world, r) for r in range(world)]
    return SchedulerSide(load_config(cfg, environ={}), geometry, namespaces, world)


def store_all(side: SchedulerSide, req: Request, world: int = 1, disk_ok: bool = True):
    meta = StepPlan()
    side.plan_stores(req, (list(range(100, 100 + req.num_tokens // BLOCK)),), req.num_tokens, meta)
    done = Counter({s.key: world for s in meta.stores})
    written = Counter({s.key: world for s in meta.stores if s.disk_slot is not None})
    report = WorkerReport(host_stored=done)
    if disk_ok:
        report.disk_written = written
    else:
        report.disk_failed = written
    side.worker_report(report)
    return meta


def write_as(tmp_path, name: str, stores, world: int = 1, ranks=None) -> None:
    """Write the chunks a scheduler planned into writer ``name``'s segments, as its workers
    would (each rank its own namespace)."""
    for rank in range(world) if ranks is None else ranks:
        disk = DiskTier([str(tmp_path)], GEO.namespace("m", "", world, rank),
                        GEO.chunk_bytes, 8 * (4096 + GEO.chunk_bytes),
                        writers=[name], share_writers=2)
        buffer = AlignedBuffer(GEO.chunk_bytes)
        assert all(disk.write(s.disk_slot, s.key, buffer.array).ok for s in stores)
        disk.close()
