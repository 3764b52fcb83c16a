"""A remote store's URL as logs, errors and ``describe()`` may show it: never a credential.

``redacted(url)`` keeps the scheme, the host, a numeric port and a numeric path (a database
number), and hides what could hold a secret: everything before the last ``@``
(``user:password@``, whatever the URL's shape), a port that is not a number (a password whose
``@host`` was forgotten reads as one: ``redis://default:PASSWORD/0``), a path that is not a
number, every query value (``?ssl_certfile=***``) and the fragment. It never raises, even on
a URL that does not parse: a URL refused as malformed is shown through it too.
"""

from __future__ import annotations

import re

HIDDEN = "***"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,40}")
_MAX_CHARS = 300


def redacted(url: str) -> str:
    """``url`` with no userinfo, no query values and no fragment (see the module)."""
    head, mark, tail = _split_query(url)
    scheme, sep, rest = head.partition("://")
    if not sep:
        scheme, rest = "", head
    if "@" in url:  # a password may hold '/', '?' or '#': hide up to the last '@' of all
        rest = HIDDEN + "@" + _after_last_at(url)
    text = (scheme + sep if sep else "") + _plain_parts(rest)
    if mark == "?":
        query, _, fragment = tail.partition("#")
        text += "?" + "&".join(_hidden_value(pair) for pair in query.split("&") if pair)
        text += "#" + HIDDEN if fragment else ""
    elif mark == "#":
        text += "#" + HIDDEN
    return text if len(text) <= _MAX_CHARS else text[:_MAX_CHARS - 3] + "..."


def _plain_parts(rest: str) -> str:
    """``host[:port][/path]`` with a port or a path that is not a number hidden."""
    netloc, slash, path = rest.partition("/")
    bracket = netloc.rfind("]")  # an IPv6 address: its colons are not a port's
    host, colon, port = netloc[:bracket + 1], *netloc[bracket + 1:].partition(":")[1:]
    if bracket < 0:
        host, colon, port = netloc.partition(":")
    if colon and not port.isdigit():
        port = HIDDEN
    if path and not path.isdigit():
        path = HIDDEN
    return host + colon + port + slash + path


def _split_query(url: str) -> tuple[str, str, str]:
    """(what comes before the first ``?`` or ``#``, that mark or "", what follows it)."""
    at = min((i for i in (url.find("?"), url.find("#")) if i >= 0), default=-1)
    return (url, "", "") if at < 0 else (url[:at], url[at], url[at + 1:])


def _after_last_at(url: str) -> str:
    """The host (and what follows it up to a query) after the last ``@`` in ``url``."""
    host = url.rpartition("@")[2]
    return _split_query(host)[0]


def shown_option(pair: str) -> str:
    """The name of a query's ``name=value`` pair, as errors may show it: a pair without
    ``=``, or a name that is not a plain word, may be a secret pasted in and is hidden."""
    name, has_value, _ = pair.partition("=")
    return name if has_value and _NAME.fullmatch(name) else HIDDEN


def _hidden_value(pair: str) -> str:
    name = shown_option(pair)
    return f"{name}={HIDDEN}" if name != HIDDEN else HIDDEN
