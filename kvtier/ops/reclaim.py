"""``kvtier gc``: give disk space back by age, size target, stale namespace or writer gone,
never touching a segment that a running process holds (removals: ``kvtier.ops.removal``).

Reports name a namespace by its id and a segment by its path under the cache root,
``<namespace id>/writers/<writer id>``.
"""

from __future__ import annotations

import errno
from array import array
from dataclasses import dataclass, field, replace

import numpy as np

from kvtier.io.safefs import SafeDir
from kvtier.ops.cache import NamespaceDir, Segment, error_text, slot_file_sizes
from kvtier.ops.clock import NamespaceClock
from kvtier.ops.provenance import damaged_reason, removal_refusal
from kvtier.ops.removal import Removal, remove_namespace, remove_segment
from kvtier.ops.segments import (
    idle_for,
    in_use,
    index_entries,
    note_leases,
    segment_problem,
    top_lock_held,
)
from kvtier.ops.slot_freeing import free_slots
from kvtier.ops.victims import SegmentChunks, victims
from kvtier.segment.names import SEATS_DIR, WRITERS_DIR
from kvtier.segment.seat_orphans import free_orphan_seats


@dataclass
class GcReport:
    chunks_freed: int = 0
    bytes_freed: int = 0  # payload bytes of the chunks freed
    namespaces_removed: list[str] = field(default_factory=list)
    segments_removed: list[str] = field(default_factory=list)  # of writers gone (``gone_s``)
    seats_freed: list[str] = field(default_factory=list)  # seats naming no segment (``gone_s``)
    skipped_in_use: list[str] = field(default_factory=list)  # segments (or namespaces)
    skipped_unsafe: list[str] = field(default_factory=list)  # not provably kvtier's, or unsafe
    unreadable: list[str] = field(default_factory=list)  # namespaces not read: ``_skip_unreadable``
    reasons: dict[str, str] = field(default_factory=dict)  # why, for skipped_unsafe and unreadable
    left: dict[str, list[str]] = field(default_factory=dict)  # entries kvtier did not write
    dry_run: bool = False
    problem: str = ""  # why the cache root's namespaces were not looked at (too many entries)

    @property
    def left_alone(self) -> bool:
        """True when something was not done: the root not listed, in use, unsafe or entries
        left behind (an ``unreadable`` namespace is left alone by design, and does not count)."""
        return bool(self.problem or self.skipped_in_use or self.skipped_unsafe or self.left)

    def skip(self, skipped: list[str], name: str, reason: str = "") -> None:
        """Record ``name`` once in ``skipped`` (a ``skipped_*`` list or ``unreadable``), and why."""
        if name not in skipped:
            skipped.append(name)
        if reason:
            self.reasons.setdefault(name, reason)


def gc(dirs: list[NamespaceDir], *, older_than_s: float | None = None,
       target_bytes: int | None = None, stale: bool = False, gone_s: float | None = None,
       dry_run: bool = False) -> GcReport:
    """Free chunks older than ``older_than_s``, then the oldest until what is stored is at most
    ``target_bytes``, by write window (``kvtier.ops.victims``: a prompt's tail before its
    head); with ``stale``, remove namespaces of another format version, and those
    without metadata that a slot header or index entry proves kvtier's; with ``gone_s``, first
    remove the segments (and give back the seats) of writers gone that long (``_is_gone``),
    and give back the seats that name no writer with a segment (``_free_seats``). Whatever is
    left alone is recorded with why (``GcReport``). A segment is in use as a change judges
    it, its lease watched too when another machine's writer left it open (``note_leases``:
    once for all of them), in a dry run as well: it says what the run would do."""
    report = GcReport(dry_run=dry_run)
    note_leases(dirs)
    chunks: list[SegmentChunks] = []
    for directory in dirs:
        if directory.unsafe:
            report.skip(report.skipped_unsafe, directory.id, directory.problem)
        elif stale and directory.status in ("stale", "orphaned"):
            _remove_stale(directory, report, dry_run)
        elif directory.readable:
            removed = _remove_gone(directory, gone_s, report, dry_run) if gone_s is not None else set()
            if older_than_s is not None or target_bytes is not None:
                chunks += _namespace_chunks(directory, report, removed)
        else:
            _skip_unreadable(directory, report)
    for written, chosen in victims(chunks, older_than_s, target_bytes):
        _free(written, chosen, report, dry_run)
    return report


def _skip_unreadable(directory: NamespaceDir, report: GcReport) -> None:
    """Record a namespace whose segments gc cannot read, and which it leaves alone: damaged
    metadata (never a reason to delete), a newer kvtier's format, or, without ``stale``,
    an older format version or no metadata (``--stale`` removes those)."""
    if directory.status == "damaged":
        why = damaged_reason(directory)
    elif directory.status == "stale":
        version = directory.meta.format_version if directory.meta else 0
        why = f"written by format version {version}; --stale removes it"
    elif directory.status == "newer":
        version = directory.meta.format_version if directory.meta else 0
        why = (f"written by format version {version}, a newer kvtier's: left to that kvtier "
               "(never removed by this one)")
    else:
        why = ("no namespace.json; --stale removes it when a slot header or index entry proves "
               "it kvtier's")
    report.skip(report.unreadable, directory.id, why)


def _free(written: SegmentChunks, chosen: np.ndarray, report: GcReport, dry_run: bool) -> None:
    """Free the chunks ``chosen`` (indexes) of ``written`` (a segment's), counting exactly
    those freed (in a dry run, every one)."""
    segment, slots = written.segment, written.slots[chosen]
    freed = array("q")
    problem = ""
    try:
        if not dry_run:
            problem = free_slots(segment, slots, written.generations[chosen], freed)
    except OSError as exc:
        if exc.errno == errno.EBUSY:  # in use since it was looked at
            report.skip(report.skipped_in_use, segment.label)
        else:
            problem = error_text(exc, str(segment.path))
    done = np.isin(slots, np.frombuffer(freed, dtype=np.int64)) if not dry_run else slice(None)
    report.chunks_freed += len(slots[done])
    report.bytes_freed += int(written.stored_bytes[chosen][done].sum())
    if problem:
        report.left[segment.label] = [problem]


NO_CLOCK = "its writer's last sign of life cannot be dated; run gc where the cache can be written"


def _is_gone(segment: Segment, gone_s: float, report: GcReport) -> bool:
    """True when the writer of ``segment`` is gone for ``gone_s`` seconds and it is not in
    use; an unsafe segment, or one in use although idle that long, is recorded as skipped."""
    problem = segment_problem(segment)
    idle: float | None = 0.0
    clock = NamespaceClock(segment.ns)
    if not problem:
        try:
            idle = idle_for(segment, clock)
        except OSError as exc:
            problem = error_text(exc, str(segment.path))
    if problem:
        report.skip(report.skipped_unsafe, segment.label, problem)
        return False
    if idle is None:  # counted as in use: how long it has been idle cannot be told
        report.skip(report.skipped_in_use, segment.label, f"{NO_CLOCK}: {clock.problem}")
        return False
    if idle < gone_s:
        return False
    if in_use(segment, watch=True):
        report.skip(report.skipped_in_use, segment.label)
        return False
    return True


def _remove_gone(directory: NamespaceDir, gone_s: float, report: GcReport,
                 dry_run: bool) -> set[str]:
    """Remove the segments of ``directory`` whose writers are gone for ``gone_s`` seconds,
    and release their seats; return the labels of the segments removed or skipped (what a
    dry run would remove, or skip). None is removed when ``seats/`` cannot be read (more
    entries than are listed): a segment's removal gives its seat back."""
    gone = [segment for segment in directory.segments if _is_gone(segment, gone_s, report)]
    skipped = {s.label for s in directory.segments} & {*report.skipped_in_use, *report.skipped_unsafe}
    if not _free_seats(directory, gone_s, report, dry_run):
        gone = []  # the reason is in ``left``, under ``<namespace id>/seats``
    if dry_run or not gone:
        report.segments_removed += [s.label for s in gone]
        return {s.label for s in gone} | skipped
    done = Removal()
    try:
        with SafeDir.open(directory.root) as top, top.subdir(directory.id) as handle, \
                handle.subdir(WRITERS_DIR) as writers:
            for segment in gone:
                remove_segment(segment, handle, writers, done)
    except OSError as exc:
        done.left[directory.id] = [error_text(exc, str(directory.path))]
    report.segments_removed += done.segments_removed
    _take_left(done, report)
    return set(done.segments_removed) | skipped | set(done.in_use) | set(done.left)


SEAT_GRACE_S = 60.0  # a seat younger than this may be one a writer is setting up elsewhere


def _free_seats(directory: NamespaceDir, gone_s: float, report: GcReport, dry_run: bool) -> bool:
    """Give back the seats of ``directory`` that name no writer with a segment, unchanged
    for ``gone_s`` (at least ``SEAT_GRACE_S``): ``free_orphan_seats``; a dry run lists them
    and changes nothing. False, and why in ``left``, when ``seats/`` could not be read."""
    try:
        with directory.open() as handle:
            freed = free_orphan_seats(handle, max(gone_s, SEAT_GRACE_S), dry_run)
    except OSError as exc:
        report.left[f"{directory.id}/{SEATS_DIR}"] = [error_text(exc, f"{directory.path}/{SEATS_DIR}")]
        return False
    report.seats_freed += [f"{directory.id}/{SEATS_DIR}/{name}" for name in freed]
    return True


def _namespace_chunks(directory: NamespaceDir, report: GcReport,
                      removed: set[str]) -> list[SegmentChunks]:
    chunks = []
    for segment in directory.segments:
        if segment.label not in removed and _free_to_change(segment, report):
            chunks.append(_chunks(segment, report))
    return chunks


def _free_to_change(segment: Segment, report: GcReport) -> bool:
    """Whether gc may change ``segment``: neither unsafe nor in use (each said in ``report``)."""
    problem = segment_problem(segment)
    if problem:
        report.skip(report.skipped_unsafe, segment.label, problem)
        return False
    if in_use(segment, watch=True):
        report.skip(report.skipped_in_use, segment.label)
        return False
    return True


def _chunks(segment: Segment, report: GcReport) -> SegmentChunks:
    try:
        with segment.open() as handle:
            return SegmentChunks.of(segment, index_entries(segment, handle,
                                                           slot_file_sizes(segment.meta, handle)))
    except OSError as exc:
        report.skip(report.skipped_unsafe, segment.label, error_text(exc, str(segment.path)))
        return SegmentChunks.of(segment, ())


def _remove_stale(directory: NamespaceDir, report: GcReport, dry_run: bool) -> None:
    refusal = removal_refusal(directory)
    directory = replace(directory, proven=not refusal)  # its clock may then be read in it
    if refusal:
        report.skip(report.skipped_unsafe, directory.id, refusal)
    elif dry_run:  # as the removal decides: each segment not in use nor unsafe goes, the
        _dry_removal(directory, report)  # rest stay, and so does the namespace with them
    else:
        done = Removal()
        try:
            remove_namespace(directory, done)
        except OSError as exc:
            done.left[directory.id] = [error_text(exc, str(directory.path))]
        report.namespaces_removed += done.removed
        report.segments_removed += done.segments_removed
        _take_left(done, report)


def _dry_removal(directory: NamespaceDir, report: GcReport) -> None:
    """What ``remove_namespace`` would do with ``directory``, said in ``report``."""
    if top_lock_held(directory):
        report.skip(report.skipped_in_use, directory.id)
        return
    kept = bool(directory.ignored)  # entries of writers/ kvtier did not write: left
    if directory.ignored:
        report.left[f"{directory.id}/{WRITERS_DIR}"] = list(directory.ignored)
    for segment in directory.segments:
        if _free_to_change(segment, report):
            report.segments_removed.append(segment.label)
        else:
            kept = True
    if not kept:
        report.namespaces_removed.append(directory.id)


def _take_left(done: Removal, report: GcReport) -> None:
    """What a removal left alone, into ``report``: in use, unsafe (with why) and left."""
    for name in done.in_use:
        report.skip(report.skipped_in_use, name)
    for name, why in done.reasons.items():
        report.skip(report.skipped_unsafe, name, why)
    report.left.update({k: v for k, v in done.left.items() if k not in done.reasons})
