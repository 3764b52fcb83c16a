"""The ``kvtier`` Typer application and what its commands share."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(
    help="kvtier: tiered KV-cache offload for LLM serving (GPU, host memory, NVMe).",
    no_args_is_help=True,
    add_completion=False,
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
console = Console(width=None if Console().is_terminal else 160)
_NOT_FINITE = {math.inf: "+Inf", -math.inf: "-Inf"}  # as Prometheus's text format writes them


def shown(text: object) -> str:
    """``text`` (from a cache directory, an endpoint, a store or the user) safe to print
    through rich: no markup, no control characters."""
    text = str(text)
    return escape(text if text.isprintable() else ascii(text))


def printable(text: str) -> str:
    """``text`` with every character that is not printable written as its escape."""
    if text.isprintable():  # the common case, at C speed
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def one_line(message: str) -> str:
    """``message`` as one printable line: its lines joined (those without a letter or digit,
    such as a parser's ``^`` marker, dropped) and control characters escaped."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if any(c.isalnum() for c in line)]
    return printable("; ".join(kept).rstrip(":") if kept else message.strip())


def strict(data: Any) -> Any:
    """``data`` with every float that is not finite as a string ("NaN", "+Inf", "-Inf"):
    JSON has no such numbers."""
    if isinstance(data, float) and not math.isfinite(data):
        return _NOT_FINITE.get(data, "NaN")
    if isinstance(data, dict):
        return {key: strict(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [strict(value) for value in data]
    return data


def emit_json(data: Any) -> None:
    """``data`` as strict JSON on stdout (see ``strict``)."""
    typer.echo(json.dumps(strict(data), indent=2, default=str, allow_nan=False))


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` on stderr, as one line (``one_line``), and return the exit to raise."""
    typer.echo(f"kvtier: {one_line(message)}", err=True)
    return typer.Exit(code)
