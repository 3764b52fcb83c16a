"""``kvtier stats URL``: a running store's or engine's kvtier metrics, as a table.

The whole exchange (connect, request, every byte of the answer) ends by one deadline, and the
answer is bounded in size: a server that trickles or never stops cannot hold the command.
"""

from __future__ import annotations

import http.client
import io
import math
import time
from typing import Annotated
from urllib.parse import SplitResult, urlsplit

import typer

from kvtier.cli.app import JsonFlag, app, console, emit_json, fail, shown
from kvtier.units import format_size

MAX_BODY = 32 * 2**20  # a store's metrics are a few KiB; anything past this is not them
PIECE = 64 * 1024
MAX_TIMEOUT_S = 3600.0  # --timeout of stats and top: more is no deadline at all


class MetricsError(Exception):
    """The endpoint answered, but not with kvtier metrics we can read."""


class _DeadlineSocket:
    """A connected socket whose every send and receive must end by ``deadline``."""

    def __init__(self, sock, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self._sock.settimeout(left)

    def sendall(self, data) -> None:
        self._arm()
        self._sock.sendall(data)

    def recv_into(self, buffer) -> int:
        self._arm()
        return self._sock.recv_into(buffer)

    def makefile(self, mode: str = "rb") -> io.BufferedReader:
        return io.BufferedReader(_Reader(self))

    def close(self) -> None:
        """Nothing: http.client closes the connection while the response still reads from it;
        :func:`fetch` closes the socket itself when the exchange is over."""


class _Reader(io.RawIOBase):
    def __init__(self, sock: _DeadlineSocket) -> None:
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._sock.recv_into(buffer)


def metrics_url(url: str) -> SplitResult:
    """``url`` as a full http(s) URL (``/metrics`` added when there is no path); raises
    ``ValueError`` when it is not one."""
    if "://" not in url:
        url = f"http://{url}"
    if url.rstrip("/").count("/") < 3:
        url = url.rstrip("/") + "/metrics"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) address: {url!r}")
    _ = parts.port  # raises ValueError on a bad port
    return parts


def fetch(parts: SplitResult, timeout: float, limit: int = MAX_BODY) -> bytes:
    """The body served at ``parts``, all of it within ``timeout`` seconds and ``limit`` bytes."""
    deadline = time.monotonic() + timeout
    host = parts.hostname
    assert host, "fetch() takes an address checked by metrics_url()"
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(host, parts.port, timeout=timeout)
    sock = None
    try:
        conn.connect()
        sock = conn.sock
        conn.sock = _DeadlineSocket(sock, deadline)
        conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""),
                     headers={"Accept": "text/plain"})
        response = conn.getresponse()
        if response.status != 200:
            raise MetricsError(f"HTTP {response.status} {response.reason}".rstrip())
        return _read_body(response, limit)
    except TimeoutError as exc:
        raise MetricsError(f"no full answer within {timeout:g} s") from exc
    finally:
        conn.close()
        if sock is not None:
            sock.close()


def _read_body(response: http.client.HTTPResponse, limit: int) -> bytes:
    too_big = MetricsError(f"the answer is larger than {format_size(limit)}; not a metrics page")
    length = response.getheader("Content-Length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    while piece := response.read(PIECE):
        body += piece
        if len(body) > limit:
            raise too_big
    return bytes(body)


def parse_samples(body: bytes) -> list[dict]:
    """The ``kvtier_*`` samples of a Prometheus text page; ``MetricsError`` if it is not one."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = []
    try:
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                if sample.name.startswith("kvtier_") and not sample.name.endswith("_created"):
                    samples.append({"name": sample.name, "labels": dict(sample.labels),
                                    "value": _number(sample.value)})
    except ValueError as exc:  # UnicodeDecodeError included
        raise MetricsError(f"not Prometheus text format ({str(exc)[:80]})") from exc
    return samples


def _number(value: float) -> float:
    """A sample's value (the parser's: an ``int`` for integral text), infinite (its sign kept)
    when it is an integer too large for a float: every value can be used as a float."""
    try:
        float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
    return value


def check_timeout(name: str, seconds: float) -> None:
    """``ValueError`` unless ``seconds`` is above 0 and at most ``MAX_TIMEOUT_S``."""
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        raise ValueError(f"{name} must be a number of seconds above 0 and at most "
                         f"{MAX_TIMEOUT_S:g}, got {seconds:g}")


def read_metrics(url: str, timeout: float = 10.0) -> list[dict]:
    """The ``kvtier_*`` samples served at ``url`` (``/metrics`` added when there is no path).

    Raises ``ValueError`` for a bad address, ``MetricsError`` for an answer that is not a
    metrics page, ``OSError`` or ``http.client.HTTPException`` when the exchange fails."""
    return parse_samples(fetch(metrics_url(url), timeout))


@app.command()
def stats(url: Annotated[str, typer.Argument(help="host:port or URL of a metrics endpoint "
                                                  "(metrics_port).")],
          timeout: Annotated[float, typer.Option(help="Seconds for the whole exchange: "
                                                      "connect, request and answer (at most "
                                                      "3600).")] = 10.0,
          as_json: JsonFlag = False) -> None:
    """Print the kvtier metrics a running store or engine serves on its metrics_port."""
    try:
        parts = metrics_url(url)
        check_timeout("--timeout", timeout)
    except ValueError as exc:
        raise fail(f"stats: {exc}") from exc
    try:
        samples = parse_samples(fetch(parts, timeout))
    except (MetricsError, OSError, http.client.HTTPException) as exc:
        raise fail(f"stats: cannot read metrics from {url}: {str(exc) or type(exc).__name__}",
                   code=1) from exc
    if not samples:
        raise fail(f"stats: no kvtier metrics at {parts.geturl()}", code=1)
    if as_json:
        emit_json({"url": url, "samples": samples})
        return
    _print(url, samples)


def _print(url: str, samples: list[dict]) -> None:
    from rich.table import Table

    table = Table("metric", "labels", "value", title=f"kvtier metrics at {shown(url)}")
    for sample in samples:
        labels = ", ".join(f"{k}={v}" for k, v in sorted(sample["labels"].items()))
        value = sample["value"]
        table.add_row(shown(sample["name"].removeprefix("kvtier_")), shown(labels),
                      f"{value:.0f}" if float(value).is_integer() else f"{value:.3f}")
    console.print(table)
