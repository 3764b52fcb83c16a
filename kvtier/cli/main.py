"""``kvtier``: look inside and operate a kvtier cache."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kvtier import __version__
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.units import format_size

app = typer.Typer(
    help="kvtier: tiered KV-cache offload for LLM serving (GPU, host memory, NVMe).",
    no_args_is_help=True,
    add_completion=False,
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


@app.command()
def version() -> None:
    """Print kvtier's version."""
    typer.echo(__version__)


@app.command()
def config(as_json: JsonFlag = False) -> None:
    """Show the effective configuration and where each value came from.

    Reads KVTIER_CONFIG and KVTIER_<KEY> variables exactly as the connector and the store do;
    exits with status 2 and names the key when a value is bad.
    """
    try:
        cfg = load_config()
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    values = cfg.as_dict()
    if as_json:
        typer.echo(json.dumps({"config": values, "sources": dict(cfg.sources)}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("key", "value", "source", title="kvtier configuration")
    for key, value in values.items():
        shown = format_size(value) if key.endswith("_capacity") else str(value)
        table.add_row(key, shown, cfg.sources.get(key, "default"))
    Console().print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
