"""What ``kvtier stats`` prints: the samples of one endpoint as a table, or, past
``TABLE_ROWS`` samples, one plain line each (a table that large takes rich seconds to lay
out and no one reads it whole: ``--json`` is for scripts), or as strict JSON, one sample a
line. Each costs time in proportion to the samples, and lines are written in batches, the
command's deadline checked between them."""

from __future__ import annotations

import json
import sys

from kvtier.cli.app import console, printable, shown, strict
from kvtier.cli.deadline import Deadline

TABLE_ROWS = 1000  # samples shown as a table; more are printed one a line
BATCH = 10_000  # lines written between looks at the deadline


def print_samples(url: str, samples: list[dict], deadline: Deadline) -> None:
    """Print ``samples`` (``parse_samples``'s) served at ``url``; ``DeadlineExpired`` saying
    how many were printed when ``deadline`` passes first."""
    if len(samples) <= TABLE_ROWS:
        _table(url, samples)
        return
    sys.stdout.write(printable(f"kvtier metrics at {url}: {len(samples):,} samples, one a "
                               f"line (more than {TABLE_ROWS:,} for a table)") + "\n")
    for start in range(0, len(samples), BATCH):
        deadline.check(f"while printing ({start:,} of {len(samples):,} samples printed)")
        sys.stdout.write("".join(f"{printable(_line(s))}\n" for s in samples[start:start + BATCH]))
    sys.stdout.flush()


def print_json(url: str, samples: list[dict], deadline: Deadline) -> None:
    """``{"url": url, "samples": [...]}`` as strict JSON (``app.strict``), one sample a line
    (each encoded by json's C encoder: an indented dump of the whole goes through its
    Python one, several times slower); ``DeadlineExpired`` as ``print_samples``."""
    sys.stdout.write(f'{{\n  "url": {json.dumps(url)},\n  "samples": [')
    for start in range(0, len(samples), BATCH):
        deadline.check(f"while printing ({start:,} of {len(samples):,} samples printed)")
        sys.stdout.write(("," if start else "") + ",".join(
            "\n    " + json.dumps(strict(s), allow_nan=False) for s in samples[start:start + BATCH]))
    sys.stdout.write("\n  ]\n}\n")
    sys.stdout.flush()


def _labels(sample: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(sample["labels"].items()))


def _value(value: float) -> str:
    if isinstance(value, int):  # read as an integer: exact, as --json gives it
        return str(value)
    return f"{value:.0f}" if value.is_integer() else f"{value:.3f}"


def _line(sample: dict) -> str:
    """One sample as a line: metric, labels and value, separated by two spaces."""
    labels = _labels(sample)
    return f"{sample['name'].removeprefix('kvtier_')}  {labels + '  ' if labels else ''}" \
           f"{_value(sample['value'])}"


def _table(url: str, samples: list[dict]) -> None:
    from rich.table import Table

    table = Table("metric", "labels", "value", title=f"kvtier metrics at {shown(url)}")
    for sample in samples:
        table.add_row(shown(sample["name"].removeprefix("kvtier_")), shown(_labels(sample)),
                      _value(sample["value"]))
    console.print(table)
