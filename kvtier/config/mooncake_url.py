"""``mooncake://<master host>:<port>?<options>``: what a Mooncake Store URL says.

Options, all optional: ``protocol`` (``tcp``, the default, or ``rdma``), ``device`` (the RDMA
devices to use, e.g. ``mlx5_0,mlx5_1``; only with rdma; empty: Mooncake picks), ``metadata``
(where transfer engines find each other: ``P2PHANDSHAKE``, the default, or an etcd/HTTP
metadata URL), ``segment`` (bytes of this process's memory lent to the pool, e.g. ``4GiB``;
default 0: a pure client, which stores nothing itself), ``host`` (the address peers reach
this client at; default: the local address that routes to the master). No credentials.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from kvtier.config.redact import redacted, shown_option
from kvtier.units import parse_size

SCHEME, PROTOCOLS, P2P = "mooncake", ("tcp", "rdma"), "P2PHANDSHAKE"
OPTIONS = ("protocol", "device", "metadata", "segment", "host")
MIN_SEGMENT, MAX_SEGMENT = 16 * 2**20, 2**40  # what one client may lend (Mooncake's limits)


@dataclass(frozen=True)
class MooncakeOptions:
    """What a ``mooncake://`` URL says (``parse_url``)."""

    master: str  # host:port of mooncake_master
    protocol: str = "tcp"
    device: str = ""
    metadata: str = P2P
    segment: int = 0
    host: str = ""  # empty: the local address that routes to the master


def parse_url(url: str) -> MooncakeOptions:
    """The options of ``url``; ``ValueError`` naming what is wrong and how to write it."""
    parts, shown = urlsplit(url), redacted(url)
    master = _master(url, parts, shown)
    given = _given(parts.query, shown)
    options = MooncakeOptions(master, given.get("protocol", "tcp"),
                              given.get("device", ""), given.get("metadata", P2P),
                              _segment(given.get("segment", "0")), given.get("host", ""))
    _check_options(options, given)
    return options


def _master(url: str, parts: SplitResult, shown: str) -> str:
    """The master's ``host:port`` that ``url`` (split as ``parts``, redacted as ``shown``)
    names; ``ValueError`` unless it is ``mooncake://host:port``, then only options."""
    if parts.scheme != SCHEME:
        raise ValueError(f"remote_url {shown!r}: a Mooncake Store URL starts with mooncake://")
    if "@" in url:
        raise ValueError(f"remote_url {shown!r} must not carry credentials (it is logged)")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"remote_url {shown!r}: the master's port is not a number") from None
    if port == 0:  # as redis_url refuses it
        raise ValueError(f"remote_url {shown!r}: port 0 is no server's port")
    if not parts.hostname or port is None:
        raise ValueError(f"remote_url {shown!r} must name the master as host:port, e.g. "
                         "mooncake://10.0.0.1:50051")
    if parts.fragment:
        raise ValueError(f"remote_url {shown!r}: a Mooncake URL has no #fragment; options go "
                         "in the query (?protocol=tcp&segment=4GiB)")
    if parts.path not in ("", "/"):
        raise ValueError(f"remote_url {shown!r}: a Mooncake URL has no path; options go in "
                         "the query (?protocol=tcp&segment=4GiB)")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    return f"{host}:{port}"


def _given(query: str, shown: str) -> dict[str, str]:
    """The options ``query`` gives, by name; ``ValueError`` for one unknown or given twice."""
    for pair in filter(None, query.split("&")):
        if unquote(pair.partition("=")[0]) not in OPTIONS:
            raise ValueError(f"remote_url option {shown_option(pair)!r} is unknown: use "
                             f"{', '.join(OPTIONS)}")
    pairs = parse_qsl(query, keep_blank_values=True)
    names = [name for name, _ in pairs]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"remote_url option {name!r} is given twice")
    return dict(pairs)


def _check_options(options: MooncakeOptions, given: Mapping[str, str]) -> None:
    """``ValueError`` for an option's value kvtier cannot use (or one in conflict)."""
    if options.protocol not in PROTOCOLS:
        raise ValueError(f"remote_url option protocol={options.protocol!r}: use tcp or rdma")
    if options.device and options.protocol != "rdma":
        raise ValueError("remote_url option device names RDMA devices: it needs protocol=rdma")
    if options.metadata != P2P and "://" not in options.metadata:
        raise ValueError(f"remote_url option metadata={options.metadata!r}: use {P2P} or a "
                         "metadata server's URL (etcd://host:2379, http://host:8080/metadata)")
    if "host" in given and not options.host:
        raise ValueError("remote_url option host is empty: name this machine's address")


def check_url(url: str) -> str:
    """``url`` if it names a Mooncake Store kvtier can use; ``ValueError`` saying what is wrong."""
    parse_url(url)
    return url


def _segment(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise ValueError(f"remote_url option segment={text!r}: {exc}") from None
    if size and not MIN_SEGMENT <= size <= MAX_SEGMENT:
        raise ValueError(f"remote_url option segment={text!r}: lend 0 (none) or 16MiB to 1TiB")
    return size
