"""Metrics as kvtier serves them: samples served over HTTP and read back (a store's, a
connector's), stand-in servers for ``kvtier stats URL``, and the Grafana dashboard's queries."""

import contextlib
import json
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kvtier.cli.stats import read_metrics
from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.worker.ledger import WorkerLedger
from kvtier.metrics import serve_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvtier.json"
NAME = re.compile(r"\bkvtier_[a-z0-9_]+")
NAME_MATCHER = re.compile(r'__name__=~"([^"]*)"')


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(board: dict) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its variables."""
    exprs = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["query"]["query"])
    return exprs


def queried_metrics(board: dict) -> set[str]:
    """The metric names the expressions name (a ``__name__`` regex is not a name)."""
    return {name for expr in queries(board) for name in NAME.findall(NAME_MATCHER.sub("", expr))}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive free loopback ports, below the kernel's ephemeral
    range: no outgoing connection of another test takes one before a server binds it (an
    engine's metrics take ``metrics_port`` and ``metrics_port + 1 + rank``)."""
    for base in random.sample(range(12000, 32000 - count), 400):
        probes: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                probes.append(socket.socket())
                probes[-1].bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        return base
    raise RuntimeError(f"no {count} free consecutive loopback ports in 12000-32000")


def served(collect: Callable) -> list[dict]:
    """The samples an endpoint serving ``collect()`` answers with, read over HTTP."""
    port = free_port()
    server = serve_metrics(port, collect)
    try:
        return read_metrics(f"127.0.0.1:{port}")
    finally:
        server.close()


def connector_samples(disk: Path | None = None, remote_url: str | None = None) -> list[dict]:
    """Samples of a scheduler side (following other engines' segments in ``disk`` when
    given, with the remote store ``remote_url`` when given) and a worker, served and read as
    the connector serves them (tests/test_readme_serve.py checks a real engine serves these
    names too)."""
    geometry = KVGeometry(num_layers=2, page_bytes=4096, block_tokens=16, hash_block_tokens=16,
                          chunk_tokens=32, kv_dtype="bfloat16", page_shape="t")
    extra = {} if disk is None else {"disk_paths": [str(disk)], "disk_capacity": "1MiB"}
    extra |= {} if remote_url is None else {"remote_url": remote_url}
    config = load_config({"chunk_tokens": 32, "host_capacity": 4 * geometry.chunk_bytes,
                          **extra}, environ={})
    side = SchedulerSide(config, geometry, [geometry.namespace("m", "", 1, 0)], 1)
    try:
        return served(side.metric_samples) + served(WorkerLedger().metric_samples)
    finally:
        side.close()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send_raw(self, data: bytes, pause: float = 0.0, limit_s: float = 30.0) -> None:
        """Write ``data`` in pieces, stopping when the client is gone or after ``limit_s``."""
        piece = 1 if pause else 64 * 1024
        end = time.monotonic() + limit_s
        with contextlib.suppress(OSError):
            for i in range(0, len(data), piece):
                if time.monotonic() > end:
                    return
                self.wfile.write(data[i:i + piece])
                self.wfile.flush()
                time.sleep(pause)


@contextlib.contextmanager
def serving(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
