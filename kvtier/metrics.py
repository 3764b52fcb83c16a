"""Prometheus metrics of a store or a connector side, served on ``metrics_port``.

Nothing is updated on the hot paths: each scrape asks the owner for a snapshot of its
counters (``collect()``), so metrics cost nothing between scrapes. prometheus-client is
imported only when a port is configured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvtier.errors import ConfigError

log = logging.getLogger("kvtier")


@dataclass
class Sample:
    """One metric: ``kvtier_<name>``, a counter (``_total``) or a gauge, with labels."""

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    values: dict[tuple[tuple[str, str], ...], float] = field(default_factory=dict)

    def add(self, value: float, **labels: str) -> Sample:
        self.values[tuple(sorted(labels.items()))] = float(value)
        return self


class MetricsServer:
    """Serves ``collect()``'s samples over HTTP on ``host``:``port`` (``metrics_host``:
    loopback unless the operator opens it to a scraper elsewhere). ``close()`` stops it."""

    def __init__(self, port: int, collect: Callable[[], Iterable[Sample]],
                 host: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server
        from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily

        families = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}

        class _Collector:
            def collect(self):
                for sample in collect():
                    keys = sorted({k for labels in sample.values for k, _ in labels})
                    family = families[sample.kind](f"kvtier_{sample.name}", sample.help, labels=keys)
                    for labels, value in sample.values.items():
                        family.add_metric([dict(labels)[k] for k in keys], value)
                    yield family

        self.registry = CollectorRegistry()
        self.registry.register(_Collector())
        self.port, self.host = port, host
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("kvtier metrics on %s port %d", host, port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(port: int, collect: Callable[[], Iterable[Sample]],
                  host: str = "127.0.0.1") -> MetricsServer:
    """A :class:`MetricsServer`; ``ConfigError`` naming ``metrics_port`` and
    ``metrics_host`` when it cannot listen."""
    try:
        return MetricsServer(port, collect, host)
    except (OSError, OverflowError) as exc:  # OverflowError: a port above 65535
        reason = getattr(exc, "strerror", None) or exc
        raise ConfigError(f"kvtier config: metrics_port={port} cannot be served on metrics_host="
                          f"{host} ({reason}); choose a free port and an address "
                          "of this machine, or metrics_port 0 for no metrics endpoint") from exc
