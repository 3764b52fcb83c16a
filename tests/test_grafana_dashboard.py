"""docs/grafana/kvtier.json queries only metrics kvtier serves: every metric name in its
PromQL is on a live endpoint (a KVStore's metrics_port, and the connector's scheduler side
and worker, served by the collectors and server the connector uses), and every label it
groups or names series by is one those metrics carry (or one Prometheus adds)."""

import re
from pathlib import Path

import pytest

from kvtier import KVStore
from kvtier.cli.stats import read_metrics
from tests.helpers.kv import SMALL
from tests.helpers.metrics import (
    NAME,
    NAME_MATCHER,
    connector_samples,
    dashboard,
    free_port,
    queried_metrics,
    queries,
)

SCRAPE_LABELS = {"instance", "job"}  # added by Prometheus to every series it scrapes


def grouping_labels(board: dict) -> set[str]:
    """Labels the expressions group by and the legends name series by."""
    labels: set[str] = set()
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            for group in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", target["expr"]):
                labels |= {label.strip() for label in group.split(",") if label.strip()}
            labels |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"]))
    return labels


def live_samples(tmp_path: Path) -> list[dict]:
    """Samples of a KVStore with a disk tier and a remote store, a scheduler side (the same)
    and a worker, read live. The remote store is a closed port: a store connects lazily, and one
    out of service serves its remote metrics all the same."""
    pytest.importorskip("redis", reason="the remote extra (redis) is not installed: a store "
                                        "cannot serve its remote tier's metrics")
    (tmp_path / "disk").mkdir(mode=0o700)
    port = free_port()
    with KVStore(SMALL, {"chunk_tokens": 16, "host_capacity": "64KiB", "disk_capacity": "1MiB",
                         "disk_paths": [str(tmp_path / "disk")], "metrics_port": port,
                         "remote_url": f"redis://127.0.0.1:{free_port()}"},
                 model="dashboard-test"):
        samples = read_metrics(f"127.0.0.1:{port}")
    return samples + connector_samples(tmp_path / "disk", f"redis://127.0.0.1:{free_port()}")


def test_every_metric_the_dashboard_queries_is_served(tmp_path):
    board = dashboard()
    samples = live_samples(tmp_path)
    names = {sample["name"] for sample in samples}
    queried = queried_metrics(board)
    assert queried - names == set(), "the dashboard queries metrics no endpoint serves"
    for pattern in {p for expr in queries(board) for p in NAME_MATCHER.findall(expr)}:
        assert any(re.fullmatch(pattern, name) for name in names), pattern
    labels = SCRAPE_LABELS | {label for sample in samples for label in sample["labels"]}
    assert grouping_labels(board) - labels == set(), "grouped by labels no metric has"


def test_the_dashboard_covers_each_endpoint_and_every_failure_counter(tmp_path):
    queried = queried_metrics(dashboard())
    samples = live_samples(tmp_path)
    failures = {s["name"] for s in samples
                if re.search(r"(corruptions|io_errors|timeouts|no_space|failures|dropped_writes)"
                             r"_total$", s["name"])}
    assert failures and failures - queried == set(), "a failure counter has no panel"
    for only_there in ("kvtier_chunks_missed_total", "kvtier_remote_bytes_total",  # a store
                       "kvtier_room_waits_total", "kvtier_worker_store_bytes_total"):
        assert only_there in queried


def test_the_dashboard_shows_every_metric_an_endpoint_serves(tmp_path):
    names = {sample["name"] for sample in live_samples(tmp_path)}
    assert {"kvtier_shared_chunks", "kvtier_worker_chunks_from_shared_total"} <= names
    assert names - queried_metrics(dashboard()) == set(), "served, and on no panel"


def test_the_dashboard_is_well_formed():
    board = dashboard()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"] == "kvtier"
    variables = {variable["name"] for variable in board["templating"]["list"]}
    assert variables == {"datasource", "instance"}
    for panel in board["panels"]:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert NAME.search(expr) and '{instance=~"$instance"}' in expr, (panel["title"], expr)
            for opening, closing in ("()", "[]", "{}"):
                assert expr.count(opening) == expr.count(closing), expr
