"""The connector's worker side over a synthetic paged cache: its geometry, a worker (and its
I/O engine), and a byte-for-byte comparison of pages."""

import torch

from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.worker.side import WorkerSide
from tests.helpers.fake_io import FakeEngine

LAYERS, BLOCKS, BLOCK, HIDDEN = 2, 16, 16, 64
GEO = KVGeometry(LAYERS, 2 * BLOCK * HIDDEN * 2, BLOCK, BLOCK, 2 * BLOCK, "bfloat16", "t")


def worker(tmp_path, disk=True, **config) -> tuple[WorkerSide, list[torch.Tensor]]:
    side, kv, _ = worker_and_engine(tmp_path, disk, **config)
    return side, kv


def worker_and_engine(tmp_path, disk=True, paths=1, **config
                      ) -> tuple[WorkerSide, list[torch.Tensor], FakeEngine | None]:
    """A worker over a synthetic paged cache, and its I/O engine (None without disk); with
    ``paths`` above 1, its disk striped over that many directories under ``tmp_path``."""
    extra = {"chunk_tokens": 2 * BLOCK, "host_capacity": 8 * GEO.chunk_bytes, **config}
    if disk:
        roots = [tmp_path] if paths == 1 else [tmp_path / f"p{i}" for i in range(paths)]
        for root in roots:
            root.mkdir(exist_ok=True)
        extra = {"disk_paths": [str(r) for r in roots], "disk_min_free": 0,
                 "disk_capacity": 8 * paths * (4096 + GEO.chunk_bytes), **extra}
    make, engines = FakeEngine.factory()
    side = WorkerSide(load_config(extra, environ={}), GEO, GEO.namespace("m", "", 1, 0),
                      io_engine=make)
    kv = list(torch.randn(LAYERS, BLOCKS, 2, BLOCK, HIDDEN).to(torch.bfloat16).unbind(0))
    side.register({f"layer{i}": t for i, t in enumerate(kv)})
    return side, kv, engines[0] if engines else None


def same(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))
