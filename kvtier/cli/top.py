"""``kvtier top URL...``: a live view of one or more kvtier metrics endpoints.

Each refresh reads every endpoint once, in turn, and ends by one deadline, ``--timeout``:
every read, its parse, the figures and the view. With ``--once`` or ``--json`` one deadline
bounds the whole command, as ``kvtier stats``'s does: ``--timeout`` seconds for all it does
besides waiting ``--interval`` between its two reads. Endpoints that each answer just inside
``--timeout`` (a server that trickles its page), or a page too large to read in time, cannot
add up past it. Rates are the change of a counter between two reads over the time between
them; a counter that went down (the endpoint restarted) counts from zero again, as
Prometheus's ``rate()`` does. An endpoint that stops answering, or a refresh that runs out
of time, ends the view: one line on stderr names it and what was cut short, exit 1.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Annotated, NoReturn

import typer

from kvtier.cli.app import JsonFlag, app, console, emit_json, fail
from kvtier.cli.deadline import Deadline, DeadlineExpired
from kvtier.cli.stats import check_timeout, metrics_url
from kvtier.cli.top_figures import EndpointFigures, figures
from kvtier.cli.top_render import render
from kvtier.cli.top_scrape import Endpoint, EndpointLost, EndpointTimedOut, Scrape, scrape

NOT_SERVING = " (is the store or engine running, with metrics_port set?)"


def _endpoints(urls: Sequence[str], interval: float, timeout: float) -> list[Endpoint]:
    """The arguments checked; ``ValueError`` naming the bad one."""
    for name, value in (("--interval", interval), ("--timeout", timeout)):
        check_timeout(name, value)
    return [Endpoint(url, metrics_url(url)) for url in urls]


def _read(endpoints: Sequence[Endpoint], deadline: Deadline) -> list[Scrape]:
    """Every endpoint read once, in turn, all by ``deadline``."""
    return [scrape(endpoint, deadline) for endpoint in endpoints]


def _figures(before: Sequence[Scrape | None], after: Sequence[Scrape],
             deadline: Deadline) -> list[EndpointFigures]:
    """The figures of each endpoint from two reads (or one: ``before`` None), by ``deadline``."""
    views = [figures(b, a, deadline) for b, a in zip(before, after, strict=True)]
    deadline.check("before showing the view")
    return views


def _live(endpoints: Sequence[Endpoint], first: list[Scrape], interval: float,
          timeout: float, deadline: Deadline) -> NoReturn:
    """Refresh the view in place every ``interval`` seconds until Ctrl-C, a lost endpoint or
    a refresh that does not end within ``timeout`` (``deadline``: the first one's)."""
    from rich.live import Live

    previous = first
    with Live(render(_figures([None] * len(first), first, deadline), interval),
              console=console, auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            deadline = Deadline.after(timeout)
            current = _read(endpoints, deadline)
            live.update(render(_figures(previous, current, deadline), interval), refresh=True)
            previous = current


@app.command()
def top(urls: Annotated[list[str], typer.Argument(
            help="host:port or URL of each metrics endpoint (metrics_port): a store, an "
                 "engine's scheduler side and its workers, or several engines.")],
        interval: Annotated[float, typer.Option(help="Seconds between refreshes (at most "
                                                     "3600).")] = 2.0,
        once: Annotated[bool, typer.Option("--once", help="Print one view, with rates over one "
                                                          "interval, and exit.")] = False,
        timeout: Annotated[float, typer.Option(help="Seconds for each refresh: reading every "
                                                    "endpoint, parsing and showing it; with "
                                                    "--once or --json, for the whole command "
                                                    "besides its --interval (at most "
                                                    "3600).")] = 5.0,
        as_json: JsonFlag = False) -> None:
    """A live view of kvtier metrics endpoints: per tier hits, hit rate and bytes in and out;
    queue depths, failures, and what is out of service (disk paths, the remote store).

    Exit 0 on Ctrl-C (or after one view with --once or --json); 1 when an endpoint does not
    answer with kvtier metrics, at the start or later, or --timeout runs out; 2 for a bad
    argument.
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
    one interval, all by one deadline: ``timeout`` seconds for everything but the wait of
    ``interval``. Raises the ``typer.Exit`` of a failed read or of the deadline."""
    deadline = Deadline.after(timeout)
    try:
        first = _read(endpoints, deadline)
    except EndpointLost as exc:
        hint = "" if isinstance(exc, EndpointTimedOut) else NOT_SERVING
        raise fail(f"top: cannot read {exc}{hint}", code=1) from None
    try:
        if live:
            _live(endpoints, first, interval, timeout, deadline)
        deadline = dataclasses.replace(deadline, at=deadline.at + interval)  # waiting is no work
        time.sleep(interval)
        return _figures(first, _read(endpoints, deadline), deadline)
    except EndpointLost as exc:
        raise fail(f"top: lost {exc}", code=1) from None
    except DeadlineExpired as exc:
        raise fail(f"top: {exc}", code=1) from None
