"""``kvtier top URL...``: a live view of one or more kvtier metrics endpoints.

Each refresh reads every endpoint once, in turn, each within ``--timeout`` seconds. Rates
are the change of a counter between two reads over the time between them; a counter that
went down (the endpoint restarted) counts from zero again, as Prometheus's ``rate()`` does.
An endpoint that stops answering ends the view: one line on stderr names it, exit 1.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Annotated, NoReturn

import typer

from kvtier.cli.app import JsonFlag, app, console, emit_json, fail
from kvtier.cli.stats import check_timeout, metrics_url
from kvtier.cli.top_figures import EndpointFigures, figures
from kvtier.cli.top_render import render
from kvtier.cli.top_scrape import Endpoint, EndpointLost, Scrape, scrape


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
