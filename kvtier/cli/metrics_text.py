"""The ``kvtier_*`` samples of a Prometheus text page, in time proportional to its lines.

prometheus_client's parser walks a page character by character (tens of µs a sample:
seconds for 100,000). Here each line is matched once against the grammar the text format's
writers produce: ``name{label="value",...} value [timestamp]`` with single spaces,
``# HELP``, ``# TYPE`` and other comments. A page with any line outside that grammar, or a
``# TYPE`` under which the library renames samples (a counter whose name lacks ``_total``),
is handed whole to prometheus_client's parser instead, so every page reads as the library
reads it (``tests/test_cli_stats_page.py`` checks both agree on generated pages). Both ways
check a ``Deadline`` every few thousand lines.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Iterator
from typing import TypeVar

from kvtier.cli.deadline import Deadline

T = TypeVar("T")
CHECK_EVERY = 4096  # lines between looks at the deadline
_WS = r"[ \t\r\x0b\x0c]"  # the whitespace the library splits comments on
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_VALUE = r'"(?:[^"\\\n]|\\[\\"n])*"'
_LABEL = rf"(?:[a-zA-Z]|_[a-zA-Z0-9])[a-zA-Z0-9_]*={_VALUE}"
_SAMPLE = re.compile(rf"({_NAME})(?:\{{((?:{_LABEL}(?:,{_LABEL})*,?)?)\}})? ([^ \t_]+)(?: -?[0-9]+)?")
_LABEL_PAIR = re.compile(r'([a-zA-Z0-9_]+)="((?:[^"\\\n]|\\[\\"n])*)"')
_COMMENT = re.compile(rf"# HELP {_NAME}(?: .*)?|# TYPE ({_NAME}) (counter|gauge|summary|histogram|"
                      rf"untyped)|#(?:{_WS}+(?!(?:HELP|TYPE)(?:{_WS}|$))[^ \t\r\x0b\x0c].*)?")
_ESCAPES = re.compile(r"\\[\\n\"]")
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


class PageError(ValueError):
    """The page is not Prometheus text format; the message says where."""


def parse_samples(text: str, deadline: Deadline | None = None) -> list[dict]:
    """The ``kvtier_*`` samples of ``text`` (``_created`` ones left out), each ``name``,
    ``labels`` and ``value`` (see ``number``); ``PageError`` when it is not Prometheus text,
    ``DeadlineExpired`` when ``deadline`` passes first."""
    samples = _fast(text, deadline, _sample)
    return _by_library(text, deadline) if samples is None else samples


Keyed = tuple[str, tuple[tuple[str, str], ...], float]  # name, labels sorted, value


def parse_keyed(text: str, deadline: Deadline | None = None) -> list[Keyed]:
    """``parse_samples``'s samples as (name, labels sorted by name, value as a float): what
    ``kvtier top`` keys its figures by, made without a dict per sample."""
    samples = _fast(text, deadline, _keyed)
    if samples is not None:
        return samples
    return [(s["name"], tuple(sorted(s["labels"].items())), float(s["value"]))
            for s in _by_library(text, deadline)]


def number(value: float) -> float:
    """A sample's value (an ``int`` for integral text, as the library reads it), infinite
    (its sign kept) when it is an integer too large for a float."""
    try:
        float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
    return value


def _fast(text: str, deadline: Deadline | None, make: Callable[[str, str | None, str], T | None]
          ) -> list[T] | None:
    """The samples (each ``make(name, labels, value)``), or None when a line is outside the
    grammar (see the module docstring), or ``make`` refuses one."""
    samples: list[T] = []
    for count, line in enumerate(text.split("\n")):
        if deadline is not None and count % CHECK_EVERY == 0:
            deadline.check(f"while parsing the page (line {count:,}, {len(samples):,} samples)")
        line = line.strip()
        if not line:
            continue
        if line[0] == "#":
            comment = _COMMENT.fullmatch(line)
            if comment is None or (comment[2] == "counter" and not comment[1].endswith("_total")):
                return None
            continue
        sample = _SAMPLE.fullmatch(line)
        if sample is None:
            return None
        name = sample[1]
        read = make(*sample.groups())
        if read is None:
            return None
        if name.startswith("kvtier_") and not name.endswith("_created"):
            samples.append(read)
    return samples


def _sample(name: str, labels: str | None, value: str) -> dict | None:
    """One sample as the library reads it; None where the library might read it otherwise
    (a label given twice, a value it refuses)."""
    if labels:
        pairs = _LABEL_PAIR.findall(labels)
        read = {k: _unescaped(v) for k, v in pairs} if "\\" in labels else dict(pairs)
        if len(read) != len(pairs):
            return None
    else:
        read = {}
    digits = value[1:] if value[0] in "+-" else value
    try:  # an int when the library reads one: decimal digits (int() would raise otherwise)
        figure: float = int(value) if digits.isdecimal() else float(value)
    except ValueError:
        return None
    if len(digits) > 300:  # an integer maybe too large for a float
        figure = number(figure)
    return {"name": name, "labels": read, "value": figure}


def _keyed(name: str, labels: str | None, value: str) -> Keyed | None:
    """One sample as ``parse_keyed`` gives it; None where ``_sample`` gives None."""
    if labels:
        pairs = _LABEL_PAIR.findall(labels)
        if "\\" in labels:
            pairs = [(k, _unescaped(v)) for k, v in pairs]
        if len(pairs) > 1 and len(dict(pairs)) != len(pairs):  # a label given twice
            return None
        key = tuple(sorted(pairs)) if len(pairs) > 1 else tuple(pairs)
    else:
        key = ()
    try:
        figure = float(value)
    except ValueError:
        return None
    return name, key, figure


def _unescaped(text: str) -> str:
    return _ESCAPES.sub(lambda m: _UNESCAPED[m[0]], text) if "\\" in text else text


def _by_library(text: str, deadline: Deadline | None) -> list[dict]:
    """prometheus_client's reading of ``text``, fed line by line past the deadline."""
    from prometheus_client.parser import text_fd_to_metric_families

    samples: list[dict] = []
    try:
        for family in text_fd_to_metric_families(_lines(text, deadline)):  # type: ignore[arg-type]
            for sample in family.samples:
                if sample.name.startswith("kvtier_") and not sample.name.endswith("_created"):
                    samples.append({"name": sample.name, "labels": dict(sample.labels),
                                    "value": number(sample.value)})
    except ValueError as exc:
        raise PageError(f"not Prometheus text format ({str(exc)[:80]})") from exc
    return samples


def _lines(text: str, deadline: Deadline | None) -> Iterator[str]:
    """The lines of ``text`` as a file yields them, the deadline checked every
    ``CHECK_EVERY``."""
    for count, line in enumerate(io.StringIO(text)):
        if deadline is not None and count % CHECK_EVERY == 0:
            deadline.check(f"while parsing the page (line {count:,})")
        yield line
