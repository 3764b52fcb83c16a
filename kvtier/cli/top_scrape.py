"""One read of a metrics endpoint for ``kvtier top``: its ``kvtier_*`` samples by name and
labels, and the endpoint lost when it does not answer with them."""

from __future__ import annotations

import http.client
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from urllib.parse import SplitResult

from kvtier.cli.deadline import Deadline
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

    @cached_property
    def _by_name(self) -> dict[str, list[Labels]]:
        """The label sets of each sample name, made once: a page of N samples costs O(N) to
        show, not O(N) per figure."""
        by_name: dict[str, list[Labels]] = {}
        for name, labels in self.values:
            by_name.setdefault(name, []).append(labels)
        return by_name

    @cached_property
    def _by_label(self) -> dict[tuple[str, str, str], list[Labels]]:
        """The label sets of each sample name that carry each (label, value), made once."""
        by_label: dict[tuple[str, str, str], list[Labels]] = {}
        for name, labels in self.values:
            for label, value in labels:
                by_label.setdefault((name, label, value), []).append(labels)
        return by_label

    def series(self, name: str, labels: Labels = ()) -> list[Labels]:
        """The label sets of the samples of ``name`` that carry all of ``labels``."""
        if not labels:
            return list(self._by_name.get(name, ()))
        (label, value), *rest = labels
        found = self._by_label.get((name, label, value), [])
        return [have for have in found if set(rest) <= set(have)] if rest else list(found)

    def value(self, name: str, labels: Labels = ()) -> float | None:
        """The sum of ``series(name, labels)``; None when there is none."""
        found = self.series(name, labels)
        return sum(self.values[(name, have)] for have in found) if found else None

    def label_values(self, name: str, label: str) -> set[str]:
        """The values ``label`` takes on the samples of ``name``."""
        return {dict(labels)[label] for labels in self._by_name.get(name, ())
                if label in dict(labels)}

    def names(self) -> set[str]:
        return set(self._by_name)


class EndpointLost(Exception):
    """An endpoint did not answer with kvtier metrics."""


@dataclass(frozen=True)
class Endpoint:
    url: str
    parts: SplitResult


def scrape(endpoint: Endpoint, timeout: float) -> Scrape:
    """One read of ``endpoint``, its page fetched and parsed within ``timeout`` seconds;
    ``EndpointLost`` saying why when it fails."""
    deadline = Deadline.after(timeout)
    try:
        samples = parse_samples(fetch(endpoint.parts, timeout, deadline=deadline), deadline)
    except (MetricsError, OSError, http.client.HTTPException) as exc:
        raise EndpointLost(f"{endpoint.url}: {str(exc) or type(exc).__name__}") from exc
    if not samples:
        raise EndpointLost(f"{endpoint.url}: no kvtier metrics at {endpoint.parts.geturl()}")
    return Scrape.of(endpoint.url, time.monotonic(), samples)
