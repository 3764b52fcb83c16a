"""docs/operations.md lists exactly the metrics each endpoint serves: a KVStore (with a disk
tier, a shared directory followed and a remote store), a vLLM engine's scheduler side (the
same) and its worker."""

import re
from pathlib import Path

import pytest

from kvtier import KVStore
from kvtier.cli.stats import read_metrics
from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.worker.ledger import WorkerLedger
from tests.helpers.kv import SMALL
from tests.helpers.metrics import free_port, served

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
TABLES = ("A `KVStore`", "A vLLM engine's scheduler side", "A vLLM engine's worker")


def documented() -> dict[str, set[str]]:
    """The metric names of each endpoint's table in the doc's Metrics section."""
    text = DOC.read_text()
    section = text[text.index("## Metrics\n"):]
    section = section[:section.index("\n## ", 1)]
    starts = [section.index(f"\n{title}") for title in TABLES] + [len(section)]
    return {title: set(re.findall(r"`(kvtier_[a-z0-9_]+)`", section[start:end]))
            for title, start, end in zip(TABLES, starts, starts[1:], strict=False)}


def names(samples: list[dict]) -> set[str]:
    return {sample["name"] for sample in samples}


def test_each_endpoint_serves_exactly_the_metrics_its_table_lists(tmp_path):
    pytest.importorskip("redis", reason="a store serves its remote metrics with redis only")
    for name in ("disk", "engine"):
        (tmp_path / name).mkdir(mode=0o700)
    remote = f"redis://127.0.0.1:{free_port()}"  # a closed port: out of service, still counted
    port = free_port()
    with KVStore(SMALL, {"chunk_tokens": 16, "host_capacity": "64KiB", "disk_capacity": "1MiB",
                         "disk_paths": [str(tmp_path / "disk")], "metrics_port": port,
                         "remote_url": remote}, model="ops-doc"):
        store = names(read_metrics(f"127.0.0.1:{port}"))
    geometry = KVGeometry(num_layers=2, page_bytes=4096, block_tokens=16, hash_block_tokens=16,
                          chunk_tokens=32, kv_dtype="bfloat16", page_shape="t")
    config = load_config({"chunk_tokens": 32, "host_capacity": 4 * geometry.chunk_bytes,
                          "disk_paths": [str(tmp_path / "engine")], "disk_capacity": "1MiB",
                          "remote_url": remote}, environ={})
    side = SchedulerSide(config, geometry, [geometry.namespace("m", "", 1, 0)], 1)
    try:
        scheduler = names(served(side.metric_samples))
    finally:
        side.close()
    worker = names(served(WorkerLedger().metric_samples))
    docs = documented()
    for title, served_names in zip(TABLES, (store, scheduler, worker), strict=True):
        assert served_names - docs[title] == set(), f"{title}: served, not in operations.md"
        assert docs[title] - served_names == set(), f"{title}: in operations.md, not served"
