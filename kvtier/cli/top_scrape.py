"""One read of a metrics endpoint for ``kvtier top``: its ``kvtier_*`` samples by name and
labels, and the endpoint lost when it does not answer with them.

Every step of a read (fetching the page, parsing it, indexing its samples) ends by the
deadline it is given, the command's or one refresh's: several endpoints, each answering just
inside ``--timeout``, cannot add up past it.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from urllib.parse import SplitResult

from kvtier.cli.deadline import Deadline, DeadlineExpired
from kvtier.cli.metrics_text import CHECK_EVERY, Keyed, parse_keyed
from kvtier.cli.stats import MetricsError, fetch, parse_samples

Labels = tuple[tuple[str, str], ...]
Key = tuple[str, Labels]
# the metrics whose ``tier`` label names the tiers an endpoint has (five at most in kvtier);
# a page with more than MAX_TIERS is not a kvtier endpoint's, and would take minutes to show
TIER_METRICS = ("kvtier_slots", "kvtier_chunks_loaded_total", "kvtier_load_bytes_total")
MAX_TIERS = 64


@dataclass(frozen=True)
class _Index:
    """The label sets of each sample name, and of each (name, label, value): the latter
    made for a (name, label) the first time it is asked for (a page of N samples then costs
    one pass, plus one pass over the samples of each name a figure looks up by label)."""

    by_name: dict[str, list[Labels]]
    by_label: dict[tuple[str, str], dict[str, list[Labels]]]

    @classmethod
    def of(cls, values: Mapping[Key, float], deadline: Deadline | None = None) -> _Index:
        """One pass over ``values``, ``deadline`` checked every ``CHECK_EVERY`` samples."""
        index = cls({}, {})
        by_name = index.by_name
        for count, (name, labels) in enumerate(values, 1):
            if deadline is not None and count % CHECK_EVERY == 0:
                deadline.check(f"while indexing the page ({count:,} of {len(values):,} samples)")
            found = by_name.get(name)
            if found is None:
                by_name[name] = [labels]
            else:
                found.append(labels)
        return index

    def labelled(self, name: str, label: str, value: str) -> list[Labels]:
        """The label sets of ``name`` whose ``label`` is ``value``."""
        by_value = self.by_label.get((name, label))
        if by_value is None:
            by_value = self.by_label[(name, label)] = {}
            for labels in self.by_name.get(name, ()):
                for have, what in labels:
                    if have == label:
                        by_value.setdefault(what, []).append(labels)
        return by_value.get(value, [])


@dataclass(frozen=True)
class Scrape:
    """The ``kvtier_*`` samples of one endpoint read at ``at`` (monotonic seconds)."""

    url: str
    at: float
    values: Mapping[Key, float]

    @classmethod
    def of(cls, url: str, at: float, samples: Sequence[dict],
           deadline: Deadline | None = None) -> Scrape:
        """From :func:`kvtier.cli.stats.parse_samples`'s samples, indexed by ``deadline``."""
        return cls.of_keyed(url, at, [(s["name"], tuple(sorted(s["labels"].items())),
                                       float(s["value"])) for s in samples], deadline)

    @classmethod
    def of_keyed(cls, url: str, at: float, samples: Sequence[Keyed],
                 deadline: Deadline | None = None) -> Scrape:
        """From ``metrics_text.parse_keyed``'s samples, indexed by ``deadline``."""
        values: dict[Key, float] = {}
        for start in range(0, len(samples), CHECK_EVERY):
            if deadline is not None:
                deadline.check(f"while reading the samples ({start:,} of {len(samples):,})")
            for name, labels, value in samples[start:start + CHECK_EVERY]:
                values[(name, labels)] = value
        made = cls(url, at, values)
        made.__dict__["_index"] = _Index.of(values, deadline)  # as cached_property stores it
        return made

    @cached_property
    def _index(self) -> _Index:
        """The label sets by name and by label, made once: a page of N samples costs O(N)
        to show, not O(N) per figure."""
        return _Index.of(self.values)

    def series(self, name: str, labels: Labels = ()) -> list[Labels]:
        """The label sets of the samples of ``name`` that carry all of ``labels``."""
        if not labels:
            return list(self._index.by_name.get(name, ()))
        (label, value), *rest = labels
        found = self._index.labelled(name, label, value)
        return [have for have in found if set(rest) <= set(have)] if rest else list(found)

    def value(self, name: str, labels: Labels = ()) -> float | None:
        """The sum of ``series(name, labels)``; None when there is none."""
        found = self.series(name, labels)
        return sum(self.values[(name, have)] for have in found) if found else None

    def label_values(self, name: str, label: str) -> set[str]:
        """The values ``label`` takes on the samples of ``name``."""
        return {dict(labels)[label] for labels in self._index.by_name.get(name, ())
                if label in dict(labels)}

    def names(self) -> set[str]:
        return set(self._index.by_name)


class EndpointLost(Exception):
    """An endpoint did not answer with kvtier metrics."""


class EndpointTimedOut(EndpointLost):
    """The deadline passed before an endpoint's page was read, parsed and indexed."""


@dataclass(frozen=True)
class Endpoint:
    url: str
    parts: SplitResult


def scrape(endpoint: Endpoint, deadline: Deadline) -> Scrape:
    """One read of ``endpoint``, its page fetched, parsed and indexed by ``deadline``;
    ``EndpointLost`` saying why when it fails (``EndpointTimedOut`` when time ran out)."""
    try:
        deadline.check("before reading it")
        samples = parse_samples(fetch(endpoint.parts, deadline.seconds, deadline=deadline),
                                deadline, parse_keyed)
        found = Scrape.of_keyed(endpoint.url, time.monotonic(), samples, deadline) \
            if samples else None
    except DeadlineExpired as exc:
        raise EndpointTimedOut(f"{endpoint.url}: {exc}") from exc
    except (MetricsError, OSError, http.client.HTTPException) as exc:
        if isinstance(exc.__cause__, TimeoutError):  # fetch's socket, armed by the deadline
            raise EndpointTimedOut(f"{endpoint.url}: --timeout {deadline.seconds:g} s ran out "
                                   "while reading the page; give a longer --timeout") from exc
        raise EndpointLost(f"{endpoint.url}: {str(exc) or type(exc).__name__}") from exc
    if found is None:
        raise EndpointLost(f"{endpoint.url}: no kvtier metrics at {endpoint.parts.geturl()}")
    tiers = {tier for name in TIER_METRICS for tier in found.label_values(name, "tier")}
    if len(tiers) > MAX_TIERS:
        raise EndpointLost(f"{endpoint.url}: {len(tiers):,} tiers, more than {MAX_TIERS} (a "
                           "kvtier endpoint has five at most); not kvtier metrics")
    return found
