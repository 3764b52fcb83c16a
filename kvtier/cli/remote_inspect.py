"""``kvtier inspect URL``: what a remote store holds, per namespace, and its memory, as a
table or as JSON, within one deadline for the whole command (``--timeout``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from kvtier.cli.app import console, emit_json, fail
from kvtier.cli.app import shown as _show
from kvtier.units import format_size

if TYPE_CHECKING:
    from kvtier.ops.remote_survey import RemoteSurvey

INSPECT_TIMEOUT_S = 60.0  # seconds the whole inspection of a remote store may take


def inspect_remote(url: str, prefix: str, limit: int, namespace: str | None,
                   as_json: bool, timeout: float = INSPECT_TIMEOUT_S) -> None:
    """``kvtier inspect URL``: the chunks under ``prefix`` (at most ``limit`` keys) of the
    namespaces starting with ``namespace``, all of it within ``timeout`` seconds (past it,
    what was seen so far, said to be cut short); exit 1 when a value checked is damaged."""
    if not timeout > 0:
        raise fail(f"--timeout must be a number of seconds above 0, not {timeout:g}")
    from rich.table import Table

    from kvtier.ops.remote_survey import SurveyError, survey

    try:
        found = survey(url, prefix, limit, timeout=timeout)
    except (SurveyError, ValueError, ImportError) as exc:  # ImportError: the extra is missing
        raise fail(str(exc)) from exc
    if namespace:
        found.namespaces = [h for h in found.namespaces if h.digest.startswith(namespace)]
    if as_json:
        emit_json(found.as_dict())
    else:
        table = Table("namespace", "chunks", "stored", "chunk size", "checked", "damaged",
                      title=f"kvtier remote store {_show(found.url)} ({_show(found.backend)}, keys "
                            f"{_show(prefix)}*)")
        for h in found.namespaces:
            table.add_row(_show(h.digest[:12]), str(h.chunks), format_size(h.value_bytes),
                          _show(h.chunk_sizes or "-"), str(h.checked), str(h.bad))
        console.print(table)
        if found.server:
            _print_server(found.server)
        _print_notes(found, timeout)
    if any(h.bad for h in found.namespaces):
        raise typer.Exit(1)


def _print_notes(found: RemoteSurvey, timeout: float) -> None:
    """What the listing left out, and the keys under the prefix that are not chunks."""
    if found.cut_short:
        console.print(f"cut short at --timeout {timeout:g} s: what {found.keys_seen} keys "
                      "listed and the values checked by then show (the store answers slowly)")
    elif not found.complete:
        console.print(f"listed the first {found.keys_seen} keys only (--limit)")
    if found.foreign_keys:
        console.print(f"{found.foreign_keys} keys under the prefix are not kvtier's")
    if found.record_logs:
        console.print(f"{found.record_logs} logs of token records (KV events' names of the "
                      "chunks)")
    if not found.namespaces:
        console.print("no kvtier chunks in this store")


def _print_server(server: dict) -> None:
    """The store's memory, limit, eviction policy and evictions (as its INFO says)."""
    used, limit = server.get("used_memory"), server.get("maxmemory")
    used_text = format_size(used) if isinstance(used, int) else _show(used or 0)
    limit_text = (format_size(limit) if isinstance(limit, int) else _show(limit)) if limit else "none"
    console.print(f"store memory {used_text} of {limit_text} "
                  f"({_show(server.get('maxmemory_policy'))}), "
                  f"{_show(server.get('evicted_keys'))} keys evicted since it started")
