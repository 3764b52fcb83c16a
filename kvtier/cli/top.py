"""``kvtier top URL...``: a live view of one or more kvtier metrics endpoints.

Each refresh reads every endpoint once, in turn, each within ``--timeout`` seconds. Rates
are the change of a counter between two reads over the time between them; a counter that
went down (the endpoint restarted) counts from zero again, as Prometheus's ``rate()`` does.
An endpoint that stops answering ends the view: one line on stderr names it, exit 1.
"""

from __future__ import annotations

import dataclasses
import http.client
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, NoReturn
from urllib.parse import SplitResult

import typer

from kvtier.cli.app import JsonFlag, app, console, emit_json, fail, shown
from kvtier.cli.stats import MetricsError, check_timeout, fetch, metrics_url, parse_samples
from kvtier.units import format_size

if TYPE_CHECKING:
    from rich.table import Table

Labels = tuple[tuple[str, str], ...]
TIER_ORDER = ("gpu", "host", "disk", "shared", "remote")
# counters of things that went wrong, by their name less ``kvtier_``/``kvtier_worker_`` and ``_total``
FAILURES = ("corruptions", "io_errors", "load_timeouts", "no_space", "dropped_writes",
            "store_failures", "disk_write_failures", "load_failures", "paths_down",
            "remote_failures", "remote_write_failures", "remote_dropped_writes", "shared_failures")
# where each kind of endpoint counts the bytes into a tier and out of it: (metric, labels)
BYTES_IN = {"disk": (("kvtier_disk_bytes_total", (("direction", "write"),)),
                     ("kvtier_worker_disk_write_bytes_total", ())),
            "host": (("kvtier_worker_store_bytes_total", ()),),
            "remote": (("kvtier_remote_bytes_total", (("direction", "write"),)),
                       ("kvtier_worker_remote_write_bytes_total", ()))}
BYTES_OUT = {"disk": (("kvtier_disk_bytes_total", (("direction", "read"),)),
                      ("kvtier_load_bytes_total", (("tier", "disk"),))),
             "host": (("kvtier_load_bytes_total", (("tier", "host"),)),),
             "shared": (("kvtier_shared_read_bytes_total", ()),
                        ("kvtier_load_bytes_total", (("tier", "shared"),))),
             "remote": (("kvtier_remote_bytes_total", (("direction", "read"),)),
                        ("kvtier_load_bytes_total", (("tier", "remote"),)))}


class Role(StrEnum):
    """What serves an endpoint, told by the metrics it serves."""

    STORE = "store"  # a KVStore
    SCHEDULER = "scheduler"  # vLLM connector, scheduler side (metrics_port)
    WORKER = "worker"  # vLLM connector, a worker (metrics_port + 1 + rank)
    OTHER = "kvtier"


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


@dataclass(frozen=True)
class TierFigures:
    """One tier of one endpoint; None where the endpoint does not count the figure, and for
    rates before a second read."""

    tier: str
    hits: float | None  # chunks loaded from this tier since the endpoint started
    hits_per_s: float | None
    hit_ratio: float | None  # share of the chunks asked for in the interval this tier served
    in_per_s: float | None  # bytes written into this tier per second
    out_per_s: float | None  # bytes read out of it per second
    fill: float | None  # share of its slots that hold a chunk


@dataclass(frozen=True)
class Failure:
    """A counter of failures: its total since start and how much it grew in the interval."""

    name: str
    total: float
    new: float | None


@dataclass(frozen=True)
class EndpointFigures:
    """What ``kvtier top`` shows of one endpoint over one interval of ``seconds`` (None
    after a single read)."""

    url: str
    role: Role
    seconds: float | None
    tiers: tuple[TierFigures, ...]
    queue_depth: float | None  # disk requests queued or running
    remote_queue_depth: float | None  # remote writes queued or running
    paths_down: float | None  # disk paths out of service now
    remote_up: float | None  # 1 while the remote store is in service, 0 while it is not
    failures: tuple[Failure, ...]  # the counters that are not zero


def role_of(scrape: Scrape) -> Role:
    names = scrape.names()
    if "kvtier_worker_loads_total" in names:
        return Role.WORKER
    if "kvtier_room_waits_total" in names or "kvtier_loads_skipped_total" in names:
        return Role.SCHEDULER
    if "kvtier_chunks_missed_total" in names:
        return Role.STORE
    return Role.OTHER


def growth(before: Scrape | None, after: Scrape, name: str, labels: Labels = ()) -> float | None:
    """How much counter ``name`` (the sum of its series with ``labels``) grew from ``before``
    to ``after``, each series from zero when it went down (a restart) or is new; None
    without a ``before`` or when ``after`` lacks it."""
    found = after.series(name, labels)
    if before is None or not found:
        return None
    grown = 0.0
    for have in found:
        now, then = after.values[(name, have)], before.values.get((name, have))
        grown += now if then is None or now < then else now - then
    return grown


def rate(before: Scrape | None, after: Scrape, name: str, labels: Labels = ()) -> float | None:
    """Counter ``name``'s growth per second from ``before`` to ``after``."""
    grown = growth(before, after, name, labels)
    if grown is None or before is None or after.at <= before.at:
        return None
    return grown / (after.at - before.at)


def _first_rate(before: Scrape | None, after: Scrape,
                candidates: Sequence[tuple[str, Labels]]) -> float | None:
    for name, labels in candidates:
        if after.value(name, labels) is not None:
            return rate(before, after, name, labels)
    return None


def _tiers(scrape: Scrape) -> list[str]:
    found: set[str] = set()
    for name in ("kvtier_slots", "kvtier_chunks_loaded_total", "kvtier_load_bytes_total"):
        found |= scrape.label_values(name, "tier")
    moved = (scrape.value(name) for name in ("kvtier_remote_bytes_total",
                                             "kvtier_worker_remote_write_bytes_total"))
    if "kvtier_remote_up" in scrape.names() or any(moved):  # a remote store is configured
        found.add("remote")
    known = [tier for tier in TIER_ORDER if tier in found]
    return known + sorted(found - set(known))


def _asked(before: Scrape | None, after: Scrape, tiers: Sequence[str]) -> float | None:
    """Chunks asked for in the interval (loaded from any tier, or missed), where counted."""
    missed = growth(before, after, "kvtier_chunks_missed_total")
    if missed is None:
        return None
    loaded = [growth(before, after, "kvtier_chunks_loaded_total", (("tier", t),)) for t in tiers]
    return missed + sum(grown or 0.0 for grown in loaded)


def tier_figures(before: Scrape | None, after: Scrape, tier: str,
                 asked: float | None) -> TierFigures:
    """``tier``'s figures; ``asked``: chunks asked for in the interval (None: not counted)."""
    by_tier = (("tier", tier),)
    loaded = growth(before, after, "kvtier_chunks_loaded_total", by_tier)
    slots, used = after.value("kvtier_slots", by_tier), after.value("kvtier_used_slots", by_tier)
    return TierFigures(
        tier=tier,
        hits=after.value("kvtier_chunks_loaded_total", by_tier),
        hits_per_s=rate(before, after, "kvtier_chunks_loaded_total", by_tier),
        hit_ratio=(loaded or 0.0) / asked if asked else None,  # no series yet: none loaded
        in_per_s=_first_rate(before, after, BYTES_IN.get(tier, ())),
        out_per_s=_first_rate(before, after, BYTES_OUT.get(tier, ())),
        fill=used / slots if slots and used is not None else None)


def _failures(before: Scrape | None, after: Scrape) -> tuple[Failure, ...]:
    found = []
    for name in sorted(after.names()):
        short = name.removeprefix("kvtier_").removeprefix("worker_").removesuffix("_total")
        total = after.value(name)
        if name.endswith("_total") and short in FAILURES and total:
            found.append(Failure(short, total, growth(before, after, name)))
    return tuple(found)


def figures(before: Scrape | None, after: Scrape) -> EndpointFigures:
    """What ``kvtier top`` shows of ``after``'s endpoint; rates over the interval since
    ``before`` (an earlier read of the same endpoint, or None)."""
    tiers = _tiers(after)
    asked = _asked(before, after, tiers)
    return EndpointFigures(
        url=after.url, role=role_of(after),
        seconds=after.at - before.at if before is not None else None,
        tiers=tuple(tier_figures(before, after, tier, asked) for tier in tiers),
        queue_depth=after.value("kvtier_io_queue_depth"),
        remote_queue_depth=after.value("kvtier_remote_queue_depth"),
        paths_down=after.value("kvtier_paths_down"),
        remote_up=after.value("kvtier_remote_up"),
        failures=_failures(before, after))


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


def _num(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def _per_s(value: float | None) -> str:
    return "-" if value is None else f"{format_size(value)}/s"


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def _queue_text(view: EndpointFigures) -> str:
    remote = view.remote_queue_depth
    return _num(view.queue_depth) + (f" + {remote:,.0f} remote" if remote else "")


def _down_text(view: EndpointFigures) -> str:
    """Disk paths and the remote store out of service."""
    if view.paths_down is None and view.remote_up is None:
        return "-"
    down = [f"{view.paths_down:,.0f} disk paths"] if view.paths_down else []
    return ", ".join(down + ["remote store"] * (view.remote_up == 0)) or "none"


def _failure_text(failures: Sequence[Failure]) -> str:
    return ", ".join(f"{f.name} {f.total:,.0f}" + (f" (+{f.new:,.0f})" if f.new else "")
                     for f in failures) or "none"


def render(views: Sequence[EndpointFigures], interval: float) -> Table:
    """The view as a rich table: a row per tier of each endpoint."""
    from rich.table import Table

    table = Table("endpoint", "role", "tier", "hits", "hits/s", "hit rate", "in/s", "out/s",
                  "fill", "queue", "failures", "out of service",
                  title=f"kvtier top: every {interval:g} s, Ctrl-C quits")
    for view in views:
        tiers = view.tiers or (TierFigures("-", None, None, None, None, None, None),)
        for i, tier in enumerate(tiers):
            first = i == 0
            table.add_row(
                shown(view.url) if first else "", str(view.role) if first else "", shown(tier.tier),
                _num(tier.hits), _num(tier.hits_per_s, ",.1f"), _percent(tier.hit_ratio),
                _per_s(tier.in_per_s), _per_s(tier.out_per_s), _percent(tier.fill),
                _queue_text(view) if first else "",
                _failure_text(view.failures) if first else "",
                _down_text(view) if first else "",
                end_section=i == len(tiers) - 1)
    return table


def _endpoints(urls: Sequence[str], interval: float, timeout: float) -> list[Endpoint]:
    """The arguments checked; ``ValueError`` naming the bad one."""
    for name, value in (("--interval", interval), ("--timeout", timeout)):
        check_timeout(name, value)
    return [Endpoint(url, metrics_url(url)) for url in urls]


def _live(endpoints: Sequence[Endpoint], first: list[Scrape], interval: float,
          timeout: float) -> NoReturn:
    """Refresh the view in place every ``interval`` seconds until Ctrl-C or a lost endpoint."""
    from rich.live import Live

    previous = first
    with Live(render([figures(None, s) for s in first], interval), console=console,
              auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            current = [scrape(endpoint, timeout) for endpoint in endpoints]
            live.update(render([figures(b, a) for b, a in zip(previous, current, strict=True)],
                               interval), refresh=True)
            previous = current


@app.command()
def top(urls: Annotated[list[str], typer.Argument(
            help="host:port or URL of each metrics endpoint (metrics_port): a store, an "
                 "engine's scheduler side and its workers, or several engines.")],
        interval: Annotated[float, typer.Option(help="Seconds between refreshes (at most "
                                                     "3600).")] = 2.0,
        once: Annotated[bool, typer.Option("--once", help="Print one view, with rates over one "
                                                          "interval, and exit.")] = False,
        timeout: Annotated[float, typer.Option(help="Seconds for each read of an endpoint (at "
                                                    "most 3600).")] = 5.0,
        as_json: JsonFlag = False) -> None:
    """A live view of kvtier metrics endpoints: per tier hits, hit rate and bytes in and out;
    queue depths, failures, and what is out of service (disk paths, the remote store).

    Exit 0 on Ctrl-C (or after one view with --once or --json); 1 when an endpoint does not
    answer with kvtier metrics, at the start or later; 2 for a bad argument.
    """
    try:
        endpoints = _endpoints(urls, interval, timeout)
    except ValueError as exc:
        raise fail(f"top: {exc}") from exc
    try:
        views = _run(endpoints, interval, timeout, live=not (once or as_json))
    except KeyboardInterrupt:
        return
    if as_json:
        emit_json([dataclasses.asdict(view) for view in views])
    else:
        console.print(render(views, interval))


def _run(endpoints: Sequence[Endpoint], interval: float, timeout: float,
         live: bool) -> list[EndpointFigures]:
    """The live view (until Ctrl-C or a lost endpoint) or, without ``live``, the figures of
    one interval. Raises the ``typer.Exit`` of a failed read."""
    try:
        first = [scrape(endpoint, timeout) for endpoint in endpoints]
    except EndpointLost as exc:
        raise fail(f"top: cannot read {exc} (is the store or engine running, with "
                   "metrics_port set?)", code=1) from None
    try:
        if live:
            _live(endpoints, first, interval, timeout)
        time.sleep(interval)
        return [figures(before, scrape(endpoint, timeout))
                for before, endpoint in zip(first, endpoints, strict=True)]
    except EndpointLost as exc:
        raise fail(f"top: lost {exc}", code=1) from None
