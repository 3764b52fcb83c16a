"""Byte sizes as people write them: "512MiB", "4GiB", "1.5GB", "4096"."""

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Return the number of bytes in ``value`` ("4GiB" -> 4294967296).

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB)
    powers of 1000; a bare number is bytes. Raises ``ValueError`` on anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {value}")
        return value
    match = _SIZE.match(str(value))
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ValueError(f"not a size: {value!r} (write e.g. 512MiB, 4GiB, 100GB or bytes)")
    return int(float(match.group(1)) * unit)


def format_size(num_bytes: float) -> str:
    """Return ``num_bytes`` in binary units with three significant digits ("1.50 GiB")."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.3g} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|[smhdw]?)\s*$")
_SECONDS = {"": 1, "ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(value: str) -> float:
    """Seconds in ``value`` ("250ms", "90s", "30m", "12h", "7d", "2w", or a bare number of
    seconds)."""
    match = _DURATION.match(str(value).lower())
    if not match:
        raise ValueError(f"not a duration: {value!r} (write e.g. 30m, 12h, 7d)")
    return float(match.group(1)) * _SECONDS[match.group(2)]
