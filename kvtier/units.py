"""Byte sizes and durations as people write them: "512MiB", "4GiB", "1.5GB", "4096", "30s";
counts given in code."""

import decimal
import math
import operator
import re
import reprlib
import threading
import time

MAX_SIZE = 2**60  # 1 EiB: more than any tier kvtier will ever be given
# a bare K, M, G or T is refused: some tools read "4G" as 4 GiB, others as 4 GB
_UNITS = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
# the units ``exact_size`` writes, largest first
_EXACT_UNITS = (("TiB", 1024**4), ("TB", 1000**4), ("GiB", 1024**3), ("GB", 1000**3),
                ("MiB", 1024**2), ("MB", 1000**2), ("KiB", 1024), ("KB", 1000))
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)


def parse_size(value: str | int | float) -> int:
    """Return the number of bytes in ``value`` ("4GiB" -> 4294967296).

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB)
    powers of 1000, in any case; a bare number, or one followed by B, is bytes. A bare K, M,
    G or T is refused (ambiguous). The result must be a whole number of bytes
    ("1.5GiB" is, "1.5" is not) from 0 to 2**60 (1 EiB). A float is taken only when it is
    integral (4294967296.0). Raises ``ValueError`` on anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"not a whole number of bytes: {value!r}")
        value = int(value)
    if isinstance(value, int):
        return _bounded(value)
    match = _SIZE.match(str(value))
    unit = match and _UNITS.get(match.group(2).lower())
    if match and match.group(2).lower() in ("k", "m", "g", "t"):
        number, letter = match.group(1), match.group(2).upper()
        raise ValueError(f"not a size: {reprlib.repr(value)} ({letter} alone is ambiguous: "
                         f"write {number}{letter}iB for powers of 1024 or {number}{letter}B "
                         "for powers of 1000)")
    if not match or unit is None:
        raise ValueError(f"not a size: {reprlib.repr(value)} (write e.g. 512MiB, 4GiB, 100GB or bytes)")
    return _bounded(_exact_bytes(match.group(1), unit))


def _exact_bytes(number: str, unit: int) -> int:
    """``number`` (ASCII digits, maybe with a fraction) times ``unit``, computed exactly."""
    whole, _, fraction = number.partition(".")
    if len(whole.lstrip("0")) > len(str(MAX_SIZE)):
        raise ValueError("size must be at most 2**60 bytes (1 EiB)")
    if not fraction:
        return int(whole.lstrip("0") or "0") * unit
    with decimal.localcontext() as context:
        context.prec = len(number) + 40  # enough digits that the product is exact
        amount = decimal.Decimal(number) * unit
        if amount != amount.to_integral_value():
            raise ValueError("not a whole number of bytes")
        return int(amount)


def _bounded(num_bytes: int) -> int:
    if num_bytes < 0:
        raise ValueError("size must not be negative")
    if num_bytes > MAX_SIZE:
        raise ValueError("size must be at most 2**60 bytes (1 EiB)")
    return num_bytes


def exact_size(num_bytes: int) -> str:
    """``num_bytes`` in the largest unit that holds it whole ("4GiB", "100GB", "1000000007"):
    ``parse_size`` reads it back to the same number."""
    for unit, factor in _EXACT_UNITS:
        if num_bytes and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return str(num_bytes)


def format_size(num_bytes: float) -> str:
    """Return ``num_bytes`` in binary units with three significant digits ("1.50 GiB")."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.3g} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|[smhdw]?)\s*$", re.ASCII)
_SECONDS = {unit: decimal.Decimal(seconds) for unit, seconds in
            {"": "1", "ms": "0.001", "s": "1", "m": "60", "h": "3600", "d": "86400",
             "w": "604800"}.items()}


def parse_duration(value: str) -> float:
    """Seconds in ``value`` ("250ms", "90s", "30m", "12h", "7d", "2w", or a bare number of
    seconds), the float nearest the exact product ("0.1m" is 6.0). Raises ``ValueError`` on
    anything else, and on a duration too long to be a finite float (hundreds of digits)."""
    match = _DURATION.match(str(value).lower())
    if not match:
        raise ValueError(f"not a duration: {reprlib.repr(value)} (write e.g. 30m, 12h, 7d)")
    number = match.group(1)
    with decimal.localcontext() as context:
        context.prec = len(number) + 10  # enough digits that the product is exact
        seconds = float(decimal.Decimal(number) * _SECONDS[match.group(2)])
    if not math.isfinite(seconds):
        raise ValueError(f"duration too long: {reprlib.repr(value)}")
    return seconds


def format_duration(seconds: float) -> str:
    """``seconds`` as ``parse_duration`` reads it back to the same float ("30s", "0.25s")."""
    if seconds.is_integer():
        return f"{int(seconds)}s"
    return f"{decimal.Decimal(repr(seconds)):f}s"  # repr: the shortest exact digits


def positive_count(value: object) -> int:
    """``value`` as an int when it is a positive integer (an int, or an integer numpy or
    torch scalar; never a bool), else 0."""
    if isinstance(value, bool):
        return 0
    try:
        return max(0, operator.index(value))  # type: ignore[arg-type]
    except TypeError:
        return 0


def time_left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (``time.monotonic()``), or None for no deadline (an
    infinite one, or one too far for a wait to take: ``wait_limit``)."""
    return None if deadline is None else wait_limit(max(0.0, deadline - time.monotonic()))


def wait_limit(seconds: float | None) -> float | None:
    """``seconds`` as a lock, condition or future wait takes it: None (no limit) for None,
    infinity, or more than ``threading.TIMEOUT_MAX`` (about 292 years; past it those waits
    raise ``OverflowError``)."""
    if seconds is None or seconds >= threading.TIMEOUT_MAX:
        return None
    return max(0.0, seconds)
