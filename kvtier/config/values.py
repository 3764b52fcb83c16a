"""Parsers of single config values: each takes what a file, the environment or code gave
and returns the typed value, or raises ``ValueError``/``TypeError`` saying what is wrong
(``kvtier.config.settings`` turns that into a ``ConfigError`` naming the key and its source)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import reprlib
from collections.abc import Callable

from kvtier.units import parse_duration, parse_size

MAX_MODEL_CHARS = 512

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 100
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 2, 8, 8, 8


def shown(value: object) -> str:
    """``repr(value)``, cut short: a bad value may be megabytes long or nested deeply."""
    try:
        text = _REPR.repr(value)
    except Exception:  # repr() of an int of 5000 digits raises; so may a stranger's __repr__
        return f"<a {type(value).__name__}>"
    return text if len(text) <= 300 else text[:297] + "..."


def shown_url(value: object) -> str:
    """As ``shown``, for a URL: without what may be a credential (``config.redact``)."""
    if not isinstance(value, str):
        return shown(value)
    from kvtier.config.redact import redacted

    return repr(redacted(value))


_INTEGER = re.compile(r"^\s*[+-]?\d{1,20}\s*$", re.ASCII)


def int_in(low: int, high: int) -> Callable[[object], int]:
    """An integer from ``low`` to ``high``: an int, an integral float (4.0), or decimal digits."""

    def parse(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise TypeError("not an integer")
        if isinstance(value, float) and not value.is_integer():  # also inf and nan
            raise ValueError("not a whole number")
        if isinstance(value, str) and not _INTEGER.match(value):
            raise ValueError("not an integer")
        number = int(value)
        if not low <= number <= high:
            raise ValueError("out of range")
        return number

    return parse


def scalar(value: object) -> str:
    """``value`` as text; only strings and numbers are values (str() of a list may be huge)."""
    if not isinstance(value, str | int | float):
        raise TypeError(f"a {type(value).__name__} is not a single value")
    return str(value)


def paths(value: object) -> tuple[str, ...]:
    """Directories as a list of strings, a JSON list or one comma-separated string.

    Each is made absolute and normalised ("/x/" is "/x"; symlinks are left alone); two
    spellings of one directory, an empty entry or a NUL byte are errors. "" or [] is none.
    """
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return ()
        value = json.loads(text) if text.startswith("[") else text.split(",")
    if not isinstance(value, list | tuple) or not all(isinstance(p, str) for p in value):
        raise ValueError("not a list of strings")
    spellings: dict[str, str] = {}
    for given in value:
        path = given.strip()
        if not path or "\0" in path:
            raise ValueError(f"{shown(given)} is not a directory name")
        normal = os.path.normpath(os.path.abspath(path))
        normal = "/" + normal.lstrip("/") if normal.startswith("//") else normal
        if normal in spellings:
            raise ValueError(f"{shown(spellings[normal])} and {shown(path)} are both {normal}")
        spellings[normal] = path
    return tuple(spellings)


def optional_port(value: object) -> int | None:
    """A TCP port 1-65535, or no port: 0, "", "none", "off", None or False (YAML reads an
    unquoted ``off`` as false)."""
    if value is None or value is False or (
            isinstance(value, str) and value.strip().lower() in ("", "none", "off")):
        return None
    return int_in(0, 65535)(value) or None


def listen_address(value: object) -> str:
    """An IP address to listen on: ``127.0.0.1``, ``0.0.0.0`` (every interface), ``::``, or
    one interface's address."""
    text = scalar(value).strip()
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise ValueError(f"{shown(value)} is not an IP address") from None


def seconds_or_off(low: float, high: float = 86400.0) -> Callable[[object], float | None]:
    """A duration from ``low`` to ``high`` seconds (``seconds_in``), or none: "off", "none",
    "never" or False (YAML reads an unquoted ``off`` as false)."""
    within = seconds_in(low, high)

    def parse(value: object) -> float | None:
        if value is False or (isinstance(value, str)
                              and value.strip().lower() in ("off", "none", "never")):
            return None
        if value is True:
            raise TypeError("true is not a duration (false is off)")
        return within(value)

    return parse


def size(value: object) -> int:
    """A size: a whole number of bytes from 0 to 2**60, such as 4096, "512MiB" or "1.5GiB"."""
    scalar(value)  # refuses a list or mapping before parse_size turns it into text
    assert isinstance(value, str | int | float), "scalar() refuses anything else"
    return parse_size(value)


def model(value: object) -> str | None:
    """A model name: 1 to 512 printable characters (no NUL), or None for "not set"."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError("not a string")
    name = value.strip()
    if not name or len(name) > MAX_MODEL_CHARS or not name.isprintable():
        raise ValueError("not 1 to 512 printable characters")
    return name


WRITER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def instance_id(value: object) -> str | None:
    """A writer id (a directory name under a shared cache), or None (empty) for "derive it"."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError("not a string")
    name = value.strip()
    if not name:
        return None
    if not WRITER_ID.fullmatch(name):
        raise ValueError("not 1 to 64 letters, digits, '.', '_' or '-' starting with a letter "
                         "or digit")
    return name


def seconds_in(low: float, high: float) -> Callable[[object], float]:
    """A duration from ``low`` to ``high`` seconds (see ``parse_duration``)."""

    def parse(value: object) -> float:
        if isinstance(value, bool):
            raise TypeError("a boolean is not a duration")
        seconds = parse_duration(scalar(value))
        if not low <= seconds <= high:
            raise ValueError("out of range")
        return seconds

    return parse


def remote_url(value: object) -> str | None:
    """A remote store's URL (``kvtier.config.remote_url.check_url``), or none: "", "none", "off",
    None or False (YAML reads an unquoted ``off`` as false)."""
    if value is None or value is False:
        return None
    if not isinstance(value, str):
        raise TypeError("not a string")
    url = value.strip()
    if not url or url.lower() in ("none", "off"):
        return None
    from kvtier.config.remote_url import check_url

    return check_url(url)


KEY_PREFIX = re.compile(r"[A-Za-z0-9._:/-]{1,64}")


def key_prefix(value: object) -> str:
    """The start of every key kvtier writes to a remote store."""
    if not isinstance(value, str) or not KEY_PREFIX.fullmatch(value):
        raise ValueError("not 1 to 64 letters, digits, '.', '_', '-', ':' or '/'")
    return value


def rate(value: object) -> float:
    """A share from 0 to 1: a number (0.001), a percentage ("0.1%") or a fraction ("1/1000");
    0, "off" or False (YAML's unquoted off) for none."""
    if value is False or (isinstance(value, str) and value.strip().lower() in ("off", "none")):
        return 0.0
    if value is True:
        raise TypeError("true is not a rate (false is off)")
    text = scalar(value).strip()
    if text.endswith("%"):
        share = float(text[:-1]) / 100
    elif "/" in text:
        top, bottom = text.split("/", 1)
        share = float(top) / float(bottom)
    else:
        share = float(text)
    if not 0.0 <= share <= 1.0:  # NaN too
        raise ValueError("not from 0 to 1")
    return share


def tolerance(value: object) -> float | None:
    """A relative tolerance from 0 to 1, or "auto" (None: set by the KV cache's dtype)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    if isinstance(value, bool):
        raise TypeError("a boolean is not a tolerance")
    share = float(scalar(value))
    if not 0.0 <= share <= 1.0:
        raise ValueError("not from 0 to 1")
    return share

