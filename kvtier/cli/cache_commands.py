"""``kvtier inspect | verify | gc | clear PATH``: a cache root's namespaces, offline; and
``kvtier inspect URL``: what a remote store holds."""

from __future__ import annotations

import functools
import reprlib
from dataclasses import asdict
from typing import Annotated

import typer

from kvtier.cli.app import JsonFlag, app, console, emit_json, fail, printable
from kvtier.cli.app import shown as _show
from kvtier.ops.cache import NamespaceDir, cache_root, error_text, namespaces
from kvtier.ops.inspect import NamespaceReport, inspect_namespace
from kvtier.ops.reclaim import GcReport
from kvtier.ops.reclaim import gc as gc_namespaces
from kvtier.ops.removal import clear as clear_namespaces
from kvtier.ops.verify import NamespaceVerify, verify_namespace
from kvtier.units import format_size, parse_duration, parse_size

PathArg = Annotated[str, typer.Argument(help="A cache root: one of the disk_paths.")]
NamespaceOpt = Annotated[str | None, typer.Option("--namespace", "-n",
                                                  help="Only namespaces whose id starts so.")]
MAX_AGE_S = 36500 * 86400.0  # --older-than and --gone: 100 years; more is no age at all


def _dirs(path: str, prefix: str | None) -> list[NamespaceDir]:
    if not path:
        raise fail("PATH is empty; name a cache directory (one of the disk_paths)")
    try:
        found = namespaces(cache_root(path))
    except OSError as exc:
        raise fail(error_text(exc, path)) from exc
    if prefix:
        found = [d for d in found if d.id.startswith(prefix)]
    return found


def _short(name: str) -> str:
    """A namespace id, or a segment's ``<id>/writers/<writer>``, with the id shortened."""
    return _show(name[:12] + name[32:])


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 0:
        return "-" + _age(-seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


@app.command()
def inspect(path: Annotated[str, typer.Argument(help="A cache root (one of the disk_paths), or "
                                                "a remote store's URL (remote_url).")],
            namespace: NamespaceOpt = None, as_json: JsonFlag = False,
            prefix: Annotated[str, typer.Option(help="The remote store's key prefix "
                                                "(remote_prefix).")] = "kvtier:",
            limit: Annotated[int, typer.Option(help="Keys of a remote store listed at most.")]
            = 1_000_000) -> None:
    """Show every namespace under PATH and its writers: what they hold, whether in use.

    Model, dtype, layout, chunk size, TP rank, chunks and slots, stored bytes, fill, age,
    compression ratio, and status (ok; stale: another format version; orphaned: no metadata;
    damaged: metadata not trusted; unsafe: an entry kvtier would not use); then each writer's
    segment: its lease (host, pid, heartbeats, age), whether it is in use, chunks and bytes.
    Exit 1 when a namespace is damaged or unsafe.

    With a remote store's URL (redis://, rediss://, redis+cluster://): its kvtier chunks per
    namespace (listed in batches, at most --limit keys), a few values of each checked down to
    their checksums, and the store's memory, limit, eviction policy and evictions. Exit 1 when
    a value checked is damaged.
    """
    if "://" in path:
        _inspect_remote(path, prefix, limit, namespace, as_json)
        return
    reports = [inspect_namespace(d) for d in _dirs(path, namespace)]
    if as_json:
        emit_json({"path": path, "namespaces": [r.as_dict() for r in reports]})
    else:
        _print_inspect(path, reports)
    if any(r.status in ("damaged", "unsafe") for r in reports):
        raise typer.Exit(1)


def _print_inspect(path: str, reports: list[NamespaceReport]) -> None:
    from rich.table import Table

    table = Table("namespace", "status", "model", "dtype", "chunk", "tp", "writers", "chunks",
                  "fill", "stored", "ratio", "age min/med/max", title=f"kvtier cache {_show(path)}")
    for r in reports:
        ages = "/".join(_age(r.age_seconds.get(k)) for k in ("min", "median", "max"))
        status = r.status + (" (in use)" if r.in_use else "")
        table.add_row(_show(r.id[:12]), status, _show(r.model[-30:]), _show(r.kv_dtype),
                      str(r.chunk_tokens), _show(r.tp), str(len(r.writers)),
                      f"{r.chunks}/{r.slots}", f"{r.fill:.0%}", format_size(r.stored_bytes),
                      f"{r.compression_ratio:.2f}", ages)
    console.print(table)
    writers = Table("namespace", "writer", "status", "host", "pid", "beats", "lease written",
                    "chunks", "stored", title="writers")
    for r in reports:
        for w in r.writers:
            status = w.status + (" (in use)" if w.in_use else "")
            writers.add_row(_show(r.id[:12]), _show(w.writer), status, _show(w.host or "-"),
                            str(w.pid or "-"), str(w.beat),
                            _age(w.lease_age_seconds) + (" ago" if w.host else ""),
                            f"{w.chunks}/{w.slots}", format_size(w.stored_bytes))
    if writers.rows:
        console.print(writers)
    for r in reports:
        if r.problem:
            console.print(f"{r.id[:12]}: {_show(r.problem)}")
        for name in r.ignored:
            console.print(f"{r.id[:12]}: writers/{_show(name)} is not a writer's segment; left alone")
    if not reports:
        console.print("no kvtier namespaces here")


def _inspect_remote(url: str, prefix: str, limit: int, namespace: str | None,
                    as_json: bool) -> None:
    from rich.table import Table

    from kvtier.ops.remote_survey import SurveyError, survey

    try:
        found = survey(url, prefix, limit)
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
        _print_server(found.server)
        if not found.complete:
            console.print(f"listed the first {found.keys_seen} keys only (--limit)")
        if found.foreign_keys:
            console.print(f"{found.foreign_keys} keys under the prefix are not kvtier's")
        if not found.namespaces:
            console.print("no kvtier chunks in this store")
    if any(h.bad for h in found.namespaces):
        raise typer.Exit(1)


def _print_server(server: dict) -> None:
    """The store's memory, limit, eviction policy and evictions (as its INFO says)."""
    used, limit = server.get("used_memory"), server.get("maxmemory")
    used_text = format_size(used) if isinstance(used, int) else _show(used or 0)
    limit_text = (format_size(limit) if isinstance(limit, int) else _show(limit)) if limit else "none"
    console.print(f"store memory {used_text} of {limit_text} "
                  f"({_show(server.get('maxmemory_policy'))}), "
                  f"{_show(server.get('evicted_keys'))} keys evicted since it started")


@app.command()
def verify(path: PathArg, namespace: NamespaceOpt = None,
           repair: Annotated[bool, typer.Option(help="Free bad slots and fix the index.")] = False,
           as_json: JsonFlag = False) -> None:
    """Check every slot's header and payload under PATH, writer by writer; exit 1 when
    anything is wrong.

    --repair frees corrupt, torn and foreign slots and fixes the index of each writer's
    segment that is not in use (one in use is checked, not repaired: exit 1).
    """
    from rich.progress import Progress

    dirs = _dirs(path, namespace)
    reports = []
    with Progress(console=console, transient=True, disable=as_json or not console.is_terminal) as bar:
        for directory in dirs:
            task = bar.add_task(f"verify {directory.id[:12]}", total=None)
            reports.append(verify_namespace(directory, repair, functools.partial(bar.advance, task)))
    problems = sum(r.problems for r in reports)
    if as_json:
        emit_json({"path": path, "problems": problems, "namespaces": [r.as_dict() for r in reports]})
    else:
        _print_verify(path, reports)
    if (problems and not repair) or any(r.problem or any(w.problem for w in r.writers)
                                        for r in reports):
        raise typer.Exit(1)


def _print_verify(path: str, reports: list[NamespaceVerify]) -> None:
    from rich.table import Table

    table = Table("namespace", "writer", "slots", "ok", "free", "corrupt", "torn", "foreign",
                  "mismatched", "unindexed", "stale index", "repaired",
                  title=f"kvtier verify {_show(path)}")
    for r in reports:
        for w in r.writers:
            table.add_row(r.id[:12], w.writer, str(w.slots), str(w.ok), str(w.free),
                          str(len(w.corrupt)), str(len(w.torn)), str(len(w.foreign)),
                          str(len(w.mismatched)), str(len(w.unindexed)), str(len(w.stale_index)),
                          str(w.repaired))
        if not r.writers:
            table.add_row(r.id[:12], "-", *["0"] * 10)
    console.print(table)
    for r in reports:
        if r.problem:
            console.print(f"{r.id[:12]}: {_show(r.problem)}")
        for w in r.writers:
            if w.problem:
                console.print(f"{r.id[:12]}/writers/{w.writer}: {_show(w.problem)}")


@app.command()
def gc(path: PathArg, namespace: NamespaceOpt = None,
       older_than: Annotated[str | None, typer.Option(help="Free chunks older than this (7d, 12h).")] = None,
       target: Annotated[str | None, typer.Option(help="Free the oldest until this much is stored.")] = None,
       stale: Annotated[bool, typer.Option(help="Remove namespaces of another format version "
                                                 "or without metadata.")] = False,
       gone: Annotated[str | None, typer.Option(help="Remove the segments of writers gone this "
                                                     "long (lease not renewed: 10m, 1d).")] = None,
       dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go; change "
                                                               "nothing.")] = False,
       as_json: JsonFlag = False) -> None:
    """Reclaim space under PATH by age, size target, stale namespace or writer gone.

    Freed slots are punched out of the files. Writers' segments that a running kvtier process
    holds, and anything kvtier cannot prove it wrote, are never touched (exit 1 then).
    """
    if older_than is None and target is None and not stale and gone is None:
        raise fail("gc: say what to reclaim: --older-than, --target, --stale and/or --gone")
    try:
        gone_s = _age_arg("--gone", gone)
        age = _age_arg("--older-than", older_than)
        size = parse_size(target) if target is not None else None
    except ValueError as exc:
        raise fail(f"gc: {exc}") from exc
    report = gc_namespaces(_dirs(path, namespace), older_than_s=age, target_bytes=size,
                           stale=stale, gone_s=gone_s, dry_run=dry_run)
    if as_json:
        emit_json(asdict(report))
    else:
        _print_gc(report, gone is not None)
    if report.left_alone:
        raise typer.Exit(1)


def _age_arg(name: str, value: str | None) -> float | None:
    """A duration argument in seconds (None when not given); ``ValueError`` naming it."""
    if value is None:
        return None
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if seconds > MAX_AGE_S:
        raise ValueError(f"{name} {reprlib.repr(value)} is longer than 36500d (100 years), "
                         "the most kvtier takes; give a shorter duration")
    return seconds


def _print_gc(report: GcReport, gone: bool) -> None:
    free, remove = ("would free", "would remove") if report.dry_run else ("freed", "removed")
    skipped = [(report.skipped_in_use, "in use"),
               (report.skipped_unsafe, "not provably kvtier's or unsafe"),
               (report.unreadable, "namespaces not read")]
    console.print(f"{free} {report.chunks_freed} chunks ({format_size(report.bytes_freed)}), "
                  f"{remove} {len(report.namespaces_removed)} namespaces"
                  + (f" and {len(report.segments_removed)} segments of writers gone" if gone else "")
                  + "".join(f"; left alone {len(names)} {what}" for names, what in skipped if names))
    for names, what in skipped:
        for name in names:
            console.print(f"{_short(name)}: left alone: {_show(report.reasons.get(name, what))}")
    for name, entries in report.left.items():
        console.print(f"{_short(name)}: left {', '.join(map(_show, entries))}")


@app.command()
def clear(path: PathArg, namespace: NamespaceOpt = None,
          yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
          as_json: JsonFlag = False) -> None:
    """Remove one namespace (--namespace) or every namespace under PATH.

    Asks first unless --yes. Removes only what kvtier provably wrote; never a writer's
    segment in use, nor entries kvtier did not write (exit 1 then, naming them).
    """
    dirs = _dirs(path, namespace)
    if not dirs:
        matching = f" matching {namespace}" if namespace else ""
        raise fail(f"clear: no kvtier namespace under {path}{matching}")
    if not yes and not typer.confirm(f"Remove {len(dirs)} namespace(s) under {printable(path)}?"):
        raise typer.Exit(1)
    done = clear_namespaces(dirs)
    if as_json:
        emit_json(asdict(done))
    else:
        console.print(f"removed {len(done.removed)} namespace(s), "
                      f"{len(done.segments_removed)} writer segment(s)"
                      + (f"; {len(done.in_use)} in use, left alone" if done.in_use else ""))
        for name in done.in_use:
            console.print(f"{_short(name)}: in use, left alone")
        for name, entries in done.left.items():
            console.print(f"{_short(name)}: left {', '.join(map(_show, entries))}")
    if done.in_use or done.left:
        raise typer.Exit(1)
