"""What ``kvtier top`` shows of one endpoint over one interval: per tier hits, hit rate,
bytes in and out and fill; queue depths, failures and what is out of service.

Rates are the change of a counter between two reads over the time between them; a counter
that went down (the endpoint restarted) counts from zero again, as Prometheus's ``rate()``
does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvtier.cli.deadline import Deadline
from kvtier.cli.top_scrape import TIER_METRICS, Labels, Scrape

TIER_ORDER = ("gpu", "host", "disk", "shared", "remote")
# counters of things that went wrong, by their name less ``kvtier_``/``kvtier_worker_`` and ``_total``
FAILURES = ("corruptions", "io_errors", "load_timeouts", "no_space", "dropped_writes",
            "store_failures", "disk_write_failures", "load_failures", "paths_down",
            "remote_failures", "remote_write_failures", "remote_dropped_writes", "shared_failures",
            "verify_mismatches")
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
    pays: float | None = None  # prefill seconds its loads saved per second they took, since start


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
    remote_nodes_out: float | None  # a cluster's nodes out of service alone
    failures: tuple[Failure, ...]  # the counters that are not zero
    hits_halted: float | None = None  # 1 once sampled checks stopped every hit


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
    for name in TIER_METRICS:
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
        fill=used / slots if slots and used is not None else None,
        pays=_ratio(after.value("kvtier_seconds_saved_total", by_tier),
                    after.value("kvtier_load_seconds_total", by_tier)))


def _ratio(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def _failures(before: Scrape | None, after: Scrape) -> tuple[Failure, ...]:
    found = []
    for name in sorted(after.names()):
        short = name.removeprefix("kvtier_").removeprefix("worker_").removesuffix("_total")
        total = after.value(name)
        if name.endswith("_total") and short in FAILURES and total:
            found.append(Failure(short, total, growth(before, after, name)))
    return tuple(found)


def figures(before: Scrape | None, after: Scrape,
            deadline: Deadline | None = None) -> EndpointFigures:
    """What ``kvtier top`` shows of ``after``'s endpoint; rates over the interval since
    ``before`` (an earlier read of the same endpoint, or None). ``DeadlineExpired`` when
    ``deadline`` passes first (it is checked before each tier)."""
    tiers = _tiers(after)
    asked = _asked(before, after, tiers)
    rows = []
    for i, tier in enumerate(tiers):
        if deadline is not None:
            deadline.check(f"while working out the figures of {after.url} (tier {i + 1} of "
                           f"{len(tiers)})")
        rows.append(tier_figures(before, after, tier, asked))
    return EndpointFigures(
        url=after.url, role=role_of(after),
        seconds=after.at - before.at if before is not None else None,
        tiers=tuple(rows),
        queue_depth=after.value("kvtier_io_queue_depth"),
        remote_queue_depth=after.value("kvtier_remote_queue_depth"),
        paths_down=after.value("kvtier_paths_down"),
        remote_up=after.value("kvtier_remote_up"),
        remote_nodes_out=after.value("kvtier_remote_nodes_out"),
        failures=_failures(before, after),
        hits_halted=after.value("kvtier_verify_halted"))
