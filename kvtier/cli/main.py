"""``kvtier``: look inside and operate a kvtier cache."""

from __future__ import annotations

import json

from kvtier import __version__
from kvtier.cli import bench, cache_commands, gpu, stats, top  # noqa: F401  (registers commands)
from kvtier.cli.app import JsonFlag, app, console, emit_json, fail, shown
from kvtier.config.settings import load_config
from kvtier.errors import ConfigError
from kvtier.units import exact_size


@app.command()
def version() -> None:
    """Print kvtier's version."""
    console.print(__version__)


@app.command()
def config(as_json: JsonFlag = False) -> None:
    """Show the effective configuration and where each value came from.

    Reads KVTIER_CONFIG and KVTIER_<KEY> variables exactly as the connector and the store do;
    exits with status 2 and names the key when a value is bad.
    """
    try:
        cfg = load_config()
    except ConfigError as exc:
        raise fail(str(exc).removeprefix("kvtier ")) from exc
    values = cfg.as_dict()
    if as_json:
        emit_json({"config": values, "sources": dict(cfg.sources)})
        return
    from rich.table import Table

    table = Table("key", "value", "source", title="kvtier configuration")
    for key, value in values.items():
        table.add_row(shown(key), shown(_shown(key, value)), shown(cfg.sources.get(key, "default")))
    console.print(table)


def _shown(key: str, value: object) -> str:
    """A value of ``as_dict`` as the key's parser reads it back: sizes exact ("1536MiB")."""
    if isinstance(value, int) and (key.endswith("_capacity") or key == "disk_min_free"):
        return exact_size(value)
    if value is None:
        return "off"
    return json.dumps(value) if isinstance(value, list) else str(value)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
