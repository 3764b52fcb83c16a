"""The view of ``kvtier top`` as a rich table: a row per tier of each endpoint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.cli.app import shown
from kvtier.cli.top_figures import EndpointFigures, Failure, TierFigures
from kvtier.units import format_size

if TYPE_CHECKING:
    from rich.table import Table


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
    """Disk paths and the remote store out of service, and hits stopped by sampled checks."""
    if view.paths_down is None and view.remote_up is None and view.hits_halted is None:
        return "-"
    down = [f"{view.paths_down:,.0f} disk paths"] if view.paths_down else []
    down += ["remote store"] * (view.remote_up == 0)
    if view.remote_up != 0 and view.remote_nodes_out:  # a cluster's nodes out alone
        down.append(f"{view.remote_nodes_out:,.0f} remote nodes")
    return ", ".join(down + ["hits (wrong KV found)"] * bool(view.hits_halted)) or "none"


def _failure_text(failures: Sequence[Failure]) -> str:
    return ", ".join(f"{f.name} {f.total:,.0f}" + (f" (+{f.new:,.0f})" if f.new else "")
                     for f in failures) or "none"


def render(views: Sequence[EndpointFigures], interval: float) -> Table:
    """The view as a rich table: a row per tier of each endpoint."""
    from rich.table import Table

    table = Table("endpoint", "role", "tier", "hits", "hits/s", "hit rate", "in/s", "out/s",
                  "fill", "saved/load", "queue", "failures", "out of service",
                  title=f"kvtier top: every {interval:g} s, Ctrl-C quits")
    for view in views:
        tiers = view.tiers or (TierFigures("-", None, None, None, None, None, None),)
        for i, tier in enumerate(tiers):
            first = i == 0
            table.add_row(
                shown(view.url) if first else "", str(view.role) if first else "", shown(tier.tier),
                _num(tier.hits), _num(tier.hits_per_s, ",.1f"), _percent(tier.hit_ratio),
                _per_s(tier.in_per_s), _per_s(tier.out_per_s), _percent(tier.fill),
                "-" if tier.pays is None else f"{tier.pays:,.1f}x",
                _queue_text(view) if first else "",
                _failure_text(view.failures) if first else "",
                _down_text(view) if first else "",
                end_section=i == len(tiers) - 1)
    return table
