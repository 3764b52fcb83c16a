"""The kinds of value some settings take: named choices (``StrEnum``) and the disk floor,
with the parsers that read them from text."""

from __future__ import annotations

import decimal
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from kvtier.config import values
from kvtier.units import parse_size


class Compression(StrEnum):
    NONE = "none"
    ZSTD = "zstd"


class WritePolicy(StrEnum):
    WRITE_THROUGH = "write_through"
    WRITE_BACK = "write_back"


class LoadPolicy(StrEnum):
    ALWAYS = "always"
    AUTO = "auto"


class EvictionPolicyName(StrEnum):
    LRU = "lru"
    FIFO = "fifo"


class ODirect(StrEnum):
    AUTO = "auto"
    ON = "true"
    OFF = "false"


@dataclass(frozen=True)
class DiskFloor:
    """Free space to leave on each disk filesystem: a fraction of it, and at least ``bytes``."""

    fraction: float = 0.0
    bytes: int = 0


def choice(kind: type[StrEnum]) -> Callable[[object], StrEnum]:
    """One of ``kind``'s values, in any case, around spaces."""

    def parse(value: object) -> StrEnum:
        try:
            return kind(values.scalar(value).strip().lower())
        except ValueError:
            raise ValueError from None  # the allowed values say it all

    return parse


def o_direct(value: object) -> StrEnum:
    """auto, true or false (as text in any case, or a boolean: YAML reads on/off as one;
    the text on and off, which kvtier once printed, too)."""
    if isinstance(value, bool):
        return ODirect.ON if value else ODirect.OFF
    if not isinstance(value, str):
        raise TypeError(f"a {type(value).__name__} is not auto, true or false")
    text = {"on": "true", "off": "false"}.get(value.strip().lower(), value)
    return choice(ODirect)(text)


_PERCENT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*%\s*", re.ASCII)


def disk_floor(value: object) -> DiskFloor:
    """A plain decimal percentage from 0 to below 100 ("5%", "0.5%"), or a size
    (see ``parse_size``)."""
    text = values.scalar(value)
    if text.strip().endswith("%"):
        match = _PERCENT.fullmatch(text)
        if not match:
            raise ValueError("not a plain percentage such as 5% or 0.5%")
        fraction = float(decimal.Decimal(match.group(1)) / 100)
        if fraction >= 1:  # also 99.999...% of more digits than a float holds
            raise ValueError("not below 100%")
        return DiskFloor(fraction=fraction)
    assert isinstance(value, str | int | float), "scalar() refuses anything else"
    return DiskFloor(bytes=parse_size(value))


def percent(fraction: float) -> str:
    """``fraction`` as the percentage ``disk_floor`` reads back to it (0.005 -> "0.5%")."""
    return f"{(decimal.Decimal(repr(fraction)) * 100).normalize():f}%"
