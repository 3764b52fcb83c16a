"""``kvtier stats URL``: a running store's or engine's kvtier metrics, as a table.

The whole command (connect, request, every byte of the answer, parsing it, printing it)
ends by one deadline, ``--timeout``, and the answer is bounded in size: a server that
trickles or never stops, or a page of a million samples, cannot hold the command. Its cost
is in proportion to the samples served (``metrics_text``, ``stats_render``).
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import math
import socket
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any
from urllib.parse import SplitResult, urlsplit

import typer

from kvtier.cli.app import JsonFlag, app, fail
from kvtier.cli.deadline import Deadline, DeadlineExpired
from kvtier.cli.metrics_text import PageError
from kvtier.cli.metrics_text import parse_samples as parse_page
from kvtier.cli.stats_render import print_json, print_samples
from kvtier.config.redact import redacted
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
    if "@" in url:  # never sent, and never shown back in a message either
        raise ValueError(f"{redacted(url)}: a metrics address takes no user or password (kvtier "
                         "sends none): give host:port")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) address: {url!r}")
    _ = parts.port  # raises ValueError on a bad port
    return parts


def fetch(parts: SplitResult, timeout: float, limit: int = MAX_BODY,
          deadline: Deadline | None = None) -> bytes:
    """The body served at ``parts``, all of it within ``timeout`` seconds (by ``deadline``
    when given: the command's own) and ``limit`` bytes."""
    deadline_at = time.monotonic() + (timeout if deadline is None else deadline.left())
    host = parts.hostname
    assert host, "fetch() takes an address checked by metrics_url()"
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    addresses = _resolved(host, deadline_at, timeout)
    conn = kind(host, parts.port, timeout=max(0.001, deadline_at - time.monotonic()))
    # to the addresses resolved within the deadline (the name stays the Host and TLS name)
    conn._create_connection = lambda at, wait, source: _connect(  # type: ignore[attr-defined]
        addresses, at[1], deadline_at, source)
    sock = None
    try:
        conn.connect()
        sock = conn.sock
        conn.sock = _DeadlineSocket(sock, deadline_at)
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


def _resolved(host: str, deadline_at: float, timeout: float) -> list[str]:
    """``host``'s addresses, in the resolver's order, the lookup bounded by ``deadline_at``:
    a resolver that does not answer holds ``getaddrinfo`` for 5 s a try and server, outside
    any socket timeout, so the lookup runs on a thread of its own, left behind when the
    time is up."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    found: list = []

    def look_up() -> None:
        try:
            found.append([a[4][0] for a in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)])
        except OSError as exc:
            found.append(exc)

    thread = threading.Thread(target=look_up, name="kvtier-resolve", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline_at - time.monotonic()))
    if not found:
        raise MetricsError(f"{host}: its name was not resolved within {timeout:g} s")
    if isinstance(found[0], OSError):
        raise found[0]
    return found[0]


def _connect(addresses: list[str], port: int, deadline_at: float, source) -> socket.socket:
    """A connection to the first of ``addresses`` that takes one (``localhost`` may name
    ``::1`` before ``127.0.0.1``), each try within what is left of the deadline."""
    error: OSError = OSError("no address")
    for address in addresses:
        try:
            return socket.create_connection((address, port), max(0.001, deadline_at - time.monotonic()),
                                            source)
        except TimeoutError:
            raise
        except OSError as exc:
            error = exc
    raise error


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


def parse_samples(body: bytes, deadline: Deadline | None = None,
                  parse: Callable[[str, Deadline | None], list[Any]] = parse_page) -> list[Any]:
    """The ``kvtier_*`` samples of a Prometheus text page (``metrics_text.parse_samples``,
    or ``parse``); ``MetricsError`` if it is not one, ``DeadlineExpired`` when ``deadline``
    passes first."""
    try:
        return parse(body.decode(), deadline)
    except UnicodeDecodeError as exc:
        raise MetricsError(f"not Prometheus text format ({str(exc)[:80]})") from exc
    except PageError as exc:
        raise MetricsError(str(exc)) from exc


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
          timeout: Annotated[float, typer.Option(help="Seconds for the whole command: "
                                                      "connect, request, answer, parsing and "
                                                      "printing it (at most 3600).")] = 10.0,
          as_json: JsonFlag = False) -> None:
    """Print the kvtier metrics a running store or engine serves on its metrics_port."""
    try:
        parts = metrics_url(url)
        check_timeout("--timeout", timeout)
    except ValueError as exc:
        raise fail(f"stats: {exc}") from exc
    deadline, body = Deadline.after(timeout), b""
    try:
        body = fetch(parts, timeout, deadline=deadline)
        samples = parse_samples(body, deadline)
        if samples:
            deadline.check(f"before printing {len(samples):,} samples")
            (print_json if as_json else print_samples)(url, samples, deadline)
    except DeadlineExpired as exc:
        raise fail(f"stats: {url}: read {format_size(len(body))}, then {exc}", code=1) from exc
    except (MetricsError, OSError, http.client.HTTPException) as exc:
        raise fail(f"stats: cannot read metrics from {url}: {str(exc) or type(exc).__name__}",
                   code=1) from exc
    if not samples:
        raise fail(f"stats: no kvtier metrics at {parts.geturl()}", code=1)
