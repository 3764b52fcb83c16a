"""``redis://host:port/db``, ``rediss://`` (TLS), ``redis+cluster://host:port`` and
``rediss+cluster://``: what a Valkey/Redis URL says.

The client is built from what this parses, never from the raw URL, so the URL can only say
what is listed here. Options (the query), all optional: with TLS (``rediss``) the files
``ssl_ca_certs``, ``ssl_ca_path``, ``ssl_certfile``, ``ssl_keyfile``, and ``ssl_cert_reqs``
(``none``, ``optional``, ``required``) and ``ssl_check_hostname`` (``true``/``false``);
``protocol`` (``2`` or ``3``). Any other option is refused, credentials above all: they come
from ``KVTIER_REMOTE_USERNAME`` and ``KVTIER_REMOTE_PASSWORD`` in the environment, since the
URL is logged and shown. A cluster has one database (0).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from kvtier.config.redact import redacted, shown_option

SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
USER_ENV, PASSWORD_ENV = "KVTIER_REMOTE_USERNAME", "KVTIER_REMOTE_PASSWORD"
TLS_FILES = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")
OPTIONS = (*TLS_FILES, "ssl_cert_reqs", "ssl_check_hostname", "protocol")
_BOOLEANS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
CREDENTIALS = (f"credentials come from the environment ({USER_ENV}, {PASSWORD_ENV}), never "
               "the URL, which is logged")


@dataclass(frozen=True)
class RedisOptions:
    """What a Redis URL says (``parse_url``); ``client`` holds the options passed on to
    the client as keyword arguments (TLS files and checks, protocol)."""

    host: str
    port: int = 6379
    db: int = 0
    tls: bool = False
    cluster: bool = False
    client: tuple[tuple[str, Any], ...] = ()


def parse_url(url: str) -> RedisOptions:
    """The options of ``url``; ``ValueError`` naming what is wrong (the URL shown redacted)."""
    shown = redacted(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port not a number or out of range, a bad IPv6 address
        raise ValueError(f"remote_url {shown!r}: {_port_problem(exc)}") from None
    if parts.scheme not in SCHEMES:
        raise ValueError(f"remote_url {shown!r}: the scheme must be one of {', '.join(SCHEMES)}")
    if "@" in url:
        raise ValueError(f"remote_url {shown!r} must not carry credentials (the URL is "
                         f"logged): set {USER_ENV} and {PASSWORD_ENV} in the environment instead")
    if not parts.hostname:
        raise ValueError(f"remote_url {shown!r} names no host, e.g. redis://10.0.0.5:6379/0")
    if port == 0:
        raise ValueError(f"remote_url {shown!r}: port 0 is no server's port")
    if parts.fragment:
        raise ValueError(f"remote_url {shown!r}: a Redis URL has no #fragment")
    tls, cluster = parts.scheme.startswith("rediss"), parts.scheme.endswith("+cluster")
    return RedisOptions(parts.hostname, port or 6379, _db(parts.path, cluster, shown), tls,
                        cluster, _query(parts.query, tls))


def check_url(url: str) -> str:
    """``url`` if it names a Redis store kvtier can use, its TLS files readable here;
    ``ValueError`` saying what is wrong (not the paths: a URL's values are never shown)."""
    for name, path in parse_url(url).client:
        if name in TLS_FILES:
            _check_tls_file(name, path)
    return url


def _check_tls_file(name: str, path: str) -> None:
    """A TLS option's file (a directory for ``ssl_ca_path``) is there and readable, so
    that a typo stops the start, naming the option, rather than failing every connection
    with a message that names neither."""
    directory = name == "ssl_ca_path"
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ValueError(f"remote_url option {name}: its path cannot be read on this machine "
                         f"({exc.strerror}); give the {'directory' if directory else 'file'} "
                         "the TLS client reads") from None
    kind_ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if not kind_ok or not os.access(path, os.R_OK | (os.X_OK if directory else 0)):
        raise ValueError(f"remote_url option {name}: its path is not a readable "
                         f"{'directory' if directory else 'regular file'} on this machine")


def _port_problem(exc: ValueError) -> str:
    text = str(exc)
    if "IPv6" in text:
        return "the host is not a valid IPv6 address (write it in brackets: [::1]:6379)"
    return "the port must be a number from 1 to 65535"


def _db(path: str, cluster: bool, shown: str) -> int:
    """The database the path names: ``/N``, or none (0)."""
    text = path[1:] if path.startswith("/") else path
    if not text:
        return 0
    if not text.isascii() or not text.isdigit() or len(text) > 9:
        raise ValueError(f"remote_url {shown!r}: the path is the database number, e.g. "
                         "redis://10.0.0.5:6379/0")
    if cluster and int(text) != 0:
        raise ValueError(f"remote_url {shown!r}: a cluster has only database 0; drop the "
                         f"/{text}")
    return int(text)


def _query(query: str, tls: bool) -> tuple[tuple[str, Any], ...]:
    """The client options the query gives, each checked (see the module)."""
    given: dict[str, Any] = {}
    for pair in filter(None, query.split("&")):
        name, _, raw = pair.partition("=")
        name, text = unquote(name), unquote(raw)
        option = f"remote_url option {shown_option(pair)!r}"
        if name not in OPTIONS:
            raise ValueError(f"{option} is not one kvtier passes on (it allows only "
                             f"{', '.join(OPTIONS)}); {CREDENTIALS}")
        if name in given:
            raise ValueError(f"{option} is given twice")
        if name.startswith("ssl_") and not tls:
            raise ValueError(f"{option} needs TLS: use rediss:// or rediss+cluster://")
        given[name] = _value(name, text, option)
    return tuple(given.items())


def _value(name: str, text: str, option: str) -> Any:
    if name == "protocol":
        if text not in ("2", "3"):
            raise ValueError(f"{option}: the protocol is 2 or 3 (RESP2, RESP3)")
        return int(text)
    if name == "ssl_check_hostname":
        if text.lower() not in _BOOLEANS:
            raise ValueError(f"{option}: true or false")
        return _BOOLEANS[text.lower()]
    if name == "ssl_cert_reqs" and text not in ("none", "optional", "required"):
        raise ValueError(f"{option}: none, optional or required")
    if not text:
        raise ValueError(f"{option} is empty: name a file")
    return text
