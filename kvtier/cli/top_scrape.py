"""One read of a metrics endpoint for ``kvtier top``: its ``kvtier_*`` samples by name and
labels, and the endpoint lost when it does not answer with them."""

from __future__ import annotations

import http.client
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import SplitResult

from kvtier.cli.stats import MetricsError, fetch, parse_samples

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Scrape:
    """The ``kvtier_*`` samples of one endpoint read at ``at`` (monotonic seconds)."""

    url: str
    at: float
    values: Mapping[tuple[str, Labels], float]

    @classmethod
    def of(cls, url: str, at: float, samples: Sequence[dict]) -> Scrape:
        """From :func:`kvtier.cli.stats.parse_samples`'s samples."""
        return cls(url, at, {(s["name"], tuple(sorted(s["labels"].items()))): float(s["value"])
                             for s in samples})

    def series(self, name: str, labels: Labels = ()) -> list[Labels]:
        """The label sets of the samples of ``name`` that carry all of ``labels``."""
        wanted = set(labels)
        return [have for sample, have in self.values if sample == name and wanted <= set(have)]

    def value(self, name: str, labels: Labels = ()) -> float | None:
        """The sum of ``series(name, labels)``; None when there is none."""
        found = self.series(name, labels)
        return sum(self.values[(name, have)] for have in found) if found else None

    def label_values(self, name: str, label: str) -> set[str]:
        """The values ``label`` takes on the samples of ``name``."""
        return {dict(labels)[label] for sample, labels in self.values
                if sample == name and label in dict(labels)}

    def names(self) -> set[str]:
        return {name for name, _ in self.values}


class EndpointLost(Exception):
    """An endpoint did not answer with kvtier metrics."""


@dataclass(frozen=True)
class Endpoint:
    url: str
    parts: SplitResult


def scrape(endpoint: Endpoint, timeout: float) -> Scrape:
    """One read of ``endpoint``; ``EndpointLost`` saying why when it fails."""
    try:
        samples = parse_samples(fetch(endpoint.parts, timeout))
    except (MetricsError, OSError, http.client.HTTPException) as exc:
        raise EndpointLost(f"{endpoint.url}: {str(exc) or type(exc).__name__}") from exc
    if not samples:
        raise EndpointLost(f"{endpoint.url}: no kvtier metrics at {endpoint.parts.geturl()}")
    return Scrape.of(endpoint.url, time.monotonic(), samples)
