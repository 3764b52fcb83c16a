"""``kvtier inspect | verify | gc | clear PATH``: a cache root's namespaces, offline; and
``kvtier inspect URL``: what a remote store holds. Their arguments and exit statuses; what
they print is ``cache_reports``'s, and a remote store's inspection ``remote_inspect``'s."""

from __future__ import annotations

import errno
import functools
import reprlib
import time
from dataclasses import asdict
from typing import Annotated

import typer

from kvtier.cli.app import JsonFlag, app, console, emit_json, fail, printable
from kvtier.cli.cache_reports import print_clear, print_gc, print_inspect, print_verify
from kvtier.cli.remote_inspect import inspect_remote
from kvtier.cli.watchdog import watchdog
from kvtier.ops.cache import NamespaceDir, cache_root, error_text, namespaces
from kvtier.ops.inspect import inspect_namespace
from kvtier.ops.reclaim import gc as gc_namespaces
from kvtier.ops.removal import Removal
from kvtier.ops.removal import clear as clear_namespaces
from kvtier.ops.segments import note_leases
from kvtier.ops.verify import verify_namespace
from kvtier.segment.names import NAMESPACE_NAME
from kvtier.units import parse_duration, parse_size

PathArg = Annotated[str, typer.Argument(help="A cache root: one of the disk_paths.")]
NamespaceOpt = Annotated[str | None, typer.Option("--namespace", "-n",
                                                  help="Only namespaces whose id starts so.")]
MAX_AGE_S = 36500 * 86400.0  # --older-than and --gone: 100 years; more is no age at all
TimeoutOpt = Annotated[float, typer.Option(help="Seconds the whole command takes at most; past "
                                           "them it stops, saying so (exit 1).")]


def _dirs(path: str, prefix: str | None) -> tuple[list[NamespaceDir], str]:
    """The namespaces under ``path`` (those whose id starts with ``prefix``), and why the
    root's were not looked at ("" when they were): it holds more entries than the commands
    list (``ROOT_LISTED``). A whole namespace id as ``prefix`` is looked up by its name, and
    the root is not listed. A ``prefix`` that names no namespace fails (exit 1)."""
    if not path:
        raise fail("PATH is empty; name a cache directory (one of the disk_paths)")
    if prefix is not None and not prefix:  # an unset shell variable: not "every namespace"
        raise fail("--namespace is empty; give a namespace id's first characters, or "
                   "leave --namespace out for every namespace")
    only = prefix if prefix is not None and NAMESPACE_NAME.fullmatch(prefix) else None
    try:
        found = namespaces(cache_root(path), only)
    except OSError as exc:
        if exc.errno != errno.E2BIG:
            raise fail(error_text(exc, path)) from exc
        return [], (f"{error_text(exc, path)}; its namespaces were not looked at (name one "
                    "with --namespace and its whole id, which is looked up without a listing)")
    chosen = [d for d in found if prefix is None or d.id.startswith(prefix)]
    if prefix is not None and not chosen:  # a typo in a script must not pass as "all clear"
        raise fail(f"no namespace under {path} has an id starting with {prefix!r}; "
                   f"`kvtier inspect {path}` lists them", code=1)
    return chosen, ""


@app.command()
def inspect(path: Annotated[str, typer.Argument(help="A cache root (one of the disk_paths), or "
                                                "a remote store's URL (remote_url).")],
            namespace: NamespaceOpt = None, as_json: JsonFlag = False,
            prefix: Annotated[str, typer.Option(help="The remote store's key prefix "
                                                "(remote_prefix).")] = "kvtier:",
            limit: Annotated[int, typer.Option(help="Keys of a remote store listed at most.")]
            = 1_000_000,
            timeout: Annotated[float | None, typer.Option(
                help="Seconds the whole command takes at most (default: 60 for a remote "
                     "store, 600 for a cache root).")] = None) -> None:
    """Show every namespace under PATH and its writers: what they hold, whether in use.

    Model, dtype, layout, chunk size, TP rank, chunks and slots, stored bytes, fill, age,
    compression ratio, and status (ok; stale: an older format version; newer: a later one;
    orphaned: no metadata; damaged: metadata not trusted; unsafe: an entry kvtier would not
    use); then each writer's segment: its lease (host, pid, heartbeats, age), whether it is
    in use, chunks and bytes.
    Exit 1 when a namespace is damaged or unsafe.

    With a remote store's URL (redis://, rediss://, redis+cluster://): its kvtier chunks per
    namespace (listed in batches, at most --limit keys), a few values of each checked down to
    their checksums, and the store's memory, limit, eviction policy and evictions. Exit 1 when
    a value checked is damaged.
    """
    if "://" in path:
        if limit < 1 or (namespace is not None and not namespace):
            raise fail("--limit must be at least 1" if limit < 1 else "--namespace is empty; "
                       "give a namespace id's first characters, or leave it out for every one")
        inspect_remote(path, prefix, limit, namespace, as_json, 60.0 if timeout is None else timeout)
        return
    with watchdog(600.0 if timeout is None else timeout, "inspect"):  # the printing too
        dirs, problem = _dirs(path, namespace)
        reports = [inspect_namespace(d) for d in dirs]
        if as_json:
            emit_json({"path": path, "problem": problem,
                       "namespaces": [r.as_dict() for r in reports]})
        else:
            print_inspect(path, reports, problem)
    if problem or any(r.status in ("damaged", "unsafe") for r in reports):
        raise typer.Exit(1)


@app.command()
def verify(path: PathArg, namespace: NamespaceOpt = None,
           repair: Annotated[bool, typer.Option(help="Free bad slots and fix the index.")] = False,
           as_json: JsonFlag = False, timeout: TimeoutOpt = 3600.0) -> None:
    """Check every slot's header and payload under PATH, writer by writer; exit 1 when
    anything is wrong.

    --repair frees corrupt, torn and foreign slots and fixes the index of each writer's
    segment that is not in use (one in use is checked, not repaired: exit 1).
    """
    with watchdog(timeout, "verify"):
        dirs, problem = _dirs(path, namespace)
        reports = _verify_all(dirs, repair, as_json)
        problems = sum(r.problems for r in reports) + bool(problem)
        if as_json:
            emit_json({"path": path, "problems": problems, "problem": problem,
                       "namespaces": [r.as_dict() for r in reports]})
        else:
            print_verify(path, reports, problem)
    if problem or (problems and not repair) or any(
            r.problem or any(w.problem for w in r.writers) for r in reports):
        raise typer.Exit(1)


def _verify_all(dirs: list[NamespaceDir], repair: bool, as_json: bool) -> list:
    from rich.progress import Progress

    reports = []
    if repair:  # the leases other machines' writers left open are watched once for all
        note_leases(dirs)
    with Progress(console=console, transient=True, disable=as_json or not console.is_terminal) as bar:
        for directory in dirs:
            task = bar.add_task(f"verify {directory.id[:12]}", total=None)
            reports.append(verify_namespace(directory, repair, functools.partial(bar.advance, task)))
    return reports


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
       as_json: JsonFlag = False, timeout: TimeoutOpt = 3600.0) -> None:
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
    with watchdog(timeout, "gc"):
        dirs, problem = _dirs(path, namespace)
        report = gc_namespaces(dirs, older_than_s=age, target_bytes=size,
                               stale=stale, gone_s=gone_s, dry_run=dry_run)
        report.problem = problem
        if as_json:
            emit_json(asdict(report))
        else:
            print_gc(report, gone is not None)
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


@app.command()
def clear(path: PathArg, namespace: NamespaceOpt = None,
          yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
          as_json: JsonFlag = False, timeout: TimeoutOpt = 600.0) -> None:
    """Remove one namespace (--namespace) or every namespace under PATH.

    Asks first unless --yes. Removes only what kvtier provably wrote; never a writer's
    segment in use, nor entries kvtier did not write (exit 1 then, naming them).
    """
    started = time.monotonic()
    with watchdog(timeout, "clear"):
        dirs, problem = _dirs(path, namespace)
    if problem:  # no namespace was looked at
        _report_clear(Removal(problem=problem), as_json)
    if not dirs:
        matching = f" matching {namespace}" if namespace else ""
        raise fail(f"clear: no kvtier namespace under {path}{matching}")
    asked = time.monotonic()
    if not yes and not typer.confirm(f"Remove {len(dirs)} namespace(s) under {printable(path)}?",
                                     err=as_json):  # stdout is the JSON's alone
        raise typer.Exit(1)
    with watchdog(timeout, "clear", timeout - (asked - started)):  # not the question's time
        _report_clear(clear_namespaces(dirs), as_json)


def _report_clear(done: Removal, as_json: bool) -> None:
    """Print what ``clear`` did; exit 1 when it left something alone."""
    if as_json:
        emit_json(asdict(done))
    else:
        print_clear(done)
    if done.in_use or done.left or done.problem:
        raise typer.Exit(1)
