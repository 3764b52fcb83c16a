"""What ``kvtier inspect | verify | gc | clear PATH`` print: their reports as tables and
lines, namespace ids shortened."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.cli.app import console
from kvtier.cli.app import shown as _show
from kvtier.ops.inspect import NamespaceReport
from kvtier.ops.reclaim import GcReport
from kvtier.ops.removal import Removal
from kvtier.ops.verify import NamespaceVerify
from kvtier.units import format_size

TABLE_ROWS = 1000  # rows shown as a table; more are printed one a line
BATCH = 10_000  # lines printed at once


def short_name(name: str) -> str:
    """A namespace id, or a segment's ``<id>/writers/<writer>``, with the id shortened."""
    return _show(name[:12] + name[32:])


def age_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 0:
        return "-" + age_text(-seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def print_rows(title: str, columns: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    """``rows`` (text safe for rich: ``shown``) as a table, or past ``TABLE_ROWS`` one line
    each: a co-writer may put as many writer-like entries in a cache as it likes, and rich
    takes seconds to lay a table of thousands out (``--json`` is for scripts)."""
    if len(rows) <= TABLE_ROWS:
        from rich.table import Table

        table = Table(*columns, title=title)
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    console.print(f"{title}: {len(rows):,} rows, one a line (more than {TABLE_ROWS:,} for a "
                  "table)\n" + "  ".join(columns), highlight=False)
    for start in range(0, len(rows), BATCH):
        console.print("\n".join("  ".join(row) for row in rows[start:start + BATCH]),
                      highlight=False)


def print_root_problem(problem: str) -> None:
    """Why the cache root's namespaces were not looked at (the reason names the root), when
    they were not."""
    if problem:
        console.print(_show(problem), highlight=False)


def print_nothing_there(path: str) -> None:
    """Say that ``path`` holds no namespace (an engine not yet started there, or a path that
    is not a cache root: a table with no rows would not say which)."""
    console.print(f"no kvtier namespace under {_show(path)}: no engine has written there "
                  "(is it one of the disk_paths?)")


def print_inspect(path: str, reports: list[NamespaceReport], problem: str = "") -> None:
    print_root_problem(problem)
    if not reports and not problem:
        print_nothing_there(path)
        return
    rows: list[tuple[str, ...]] = []
    for r in reports:
        ages = "/".join(age_text(r.age_seconds.get(k)) for k in ("min", "median", "max"))
        status = r.status + (" (in use)" if r.in_use else "")
        rows.append((_show(r.id[:12]), status, _show(r.model[-30:]), _show(r.kv_dtype),
                     str(r.chunk_tokens), _show(r.tp), str(len(r.writers)),
                     f"{r.chunks}/{r.slots}", f"{r.fill:.0%}", format_size(r.stored_bytes),
                     f"{r.compression_ratio:.2f}", ages))
    print_rows(f"kvtier cache {_show(path)}", ("namespace", "status", "model", "dtype", "chunk",
                                               "tp", "writers", "chunks", "fill", "stored",
                                               "ratio", "age min/med/max"), rows)
    writers = [(_show(r.id[:12]), _show(w.writer), w.status + (" (in use)" if w.in_use else ""),
                _show(w.host or "-"), str(w.pid or "-"), str(w.beat),
                age_text(w.lease_age_seconds) + (" ago" if w.host else ""),
                f"{w.chunks}/{w.slots}", format_size(w.stored_bytes))
               for r in reports for w in r.writers]
    if writers:
        print_rows("writers", ("namespace", "writer", "status", "host", "pid", "beats",
                               "lease written", "chunks", "stored"), writers)
    for r in reports:
        if r.problem:
            console.print(f"{r.id[:12]}: {_show(r.problem)}")
        if r.clock_problem:
            console.print(f"{r.id[:12]}: {_show(r.clock_problem)}")
        if r.halted:
            console.print(f"{r.id[:12]}: engines found wrong KV while serving and serve no hits "
                          "(halt.json): `kvtier verify --repair` ends it")
        for name in r.ignored:
            console.print(f"{r.id[:12]}: writers/{_show(name)} is not a writer's segment; left alone")
    if not reports and not problem:
        console.print("no kvtier namespaces here")


def print_verify(path: str, reports: list[NamespaceVerify], problem: str = "") -> None:
    print_root_problem(problem)
    if not reports and not problem:
        print_nothing_there(path)
        return
    rows: list[tuple[str, ...]] = []
    for r in reports:
        for w in r.writers:
            writer = _show(w.writer) + (" (in use)" if w.in_use else "")
            rows.append((r.id[:12], writer, str(w.slots), str(w.ok), str(w.free),
                         str(len(w.corrupt)), str(len(w.torn)), str(len(w.foreign)),
                         str(len(w.mismatched)), str(len(w.unindexed)), str(len(w.removed)),
                         str(len(w.stale_index)), str(w.repaired)))
        if not r.writers:
            rows.append((r.id[:12], "-", *["0"] * 11))
    if rows or not problem:  # nothing was looked at: no empty table
        print_rows(f"kvtier verify {_show(path)}", ("namespace", "writer", "slots", "ok", "free",
                                                    "corrupt", "torn", "foreign", "mismatched",
                                                    "unindexed", "removed", "stale index",
                                                    "repaired"), rows)
    for r in reports:
        for problem in (r.problem, r.clock_problem):
            if problem:
                console.print(f"{r.id[:12]}: {_show(problem)}")
        if r.halted:
            console.print(f"{r.id[:12]}: engines found wrong KV while serving and serve no "
                          "hits (halt.json): " + ("removed, hits are served again"
                                                  if r.halt_removed else
                                                  "check the cache, then --repair ends it"))
        for w in r.writers:
            if w.problem:
                console.print(f"{r.id[:12]}/writers/{w.writer}: {_show(w.problem)}")


def print_gc(report: GcReport, gone: bool) -> None:
    print_root_problem(report.problem)
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
            console.print(f"{short_name(name)}: left alone: {_show(report.reasons.get(name, what))}")
    for name, entries in report.left.items():
        console.print(f"{short_name(name)}: left {', '.join(map(_show, entries))}")


def print_clear(done: Removal) -> None:
    """What ``kvtier clear`` removed, and what it left alone."""
    print_root_problem(done.problem)
    console.print(f"removed {len(done.removed)} namespace(s), "
                  f"{len(done.segments_removed)} writer segment(s)"
                  + (f"; {len(done.in_use)} in use, left alone" if done.in_use else ""))
    for name in done.in_use:
        console.print(f"{short_name(name)}: in use, left alone")
    for name, entries in done.left.items():
        if name in done.reasons:
            console.print(f"{short_name(name)}: left alone: {_show(done.reasons[name])}")
        else:
            console.print(f"{short_name(name)}: left {', '.join(map(_show, entries))}")
