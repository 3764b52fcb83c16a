"""The ``kvtier`` Typer application and what its commands share."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console

app = typer.Typer(
    help="kvtier: tiered KV-cache offload for LLM serving (GPU, host memory, NVMe).",
    no_args_is_help=True,
    add_completion=False,
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
console = Console(width=None if Console().is_terminal else 160)


def emit_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` on stderr and return the exit to raise."""
    typer.echo(f"kvtier: {message}", err=True)
    return typer.Exit(code)
