"""``kvtier gc``: give disk space back by age, size target, stale namespace or writer gone,
never touching a segment that a running process holds (removals: ``kvtier.ops.removal``).

Reports name a namespace by its id and a segment by its path under the cache root,
``<namespace id>/writers/<writer id>``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvtier.io.names import SEATS_DIR, WRITERS_DIR
from kvtier.io.safefs import SafeDir
from kvtier.io.seats import free_orphan_seats, orphan_seats, release_seat
from kvtier.ops.cache import NamespaceDir, Segment, slot_file_sizes
from kvtier.ops.removal import Removal, remove_namespace, remove_segment
from kvtier.ops.segments import free_slots, gone_for, in_use, index_entries, is_proven, namespace_in_use


@dataclass
class GcReport:
    chunks_freed: int = 0
    bytes_freed: int = 0  # payload bytes of the chunks freed
    namespaces_removed: list[str] = field(default_factory=list)
    segments_removed: list[str] = field(default_factory=list)  # of writers gone (``gone_s``)
    seats_freed: list[str] = field(default_factory=list)  # seats naming no segment (``gone_s``)
    skipped_in_use: list[str] = field(default_factory=list)  # segments (or namespaces)
    skipped_unsafe: list[str] = field(default_factory=list)  # not provably kvtier's, or unsafe
    left: dict[str, list[str]] = field(default_factory=dict)  # entries kvtier did not write
    dry_run: bool = False

    @property
    def left_alone(self) -> bool:
        """True when something was not done: in use, unsafe or entries left behind."""
        return bool(self.skipped_in_use or self.skipped_unsafe or self.left)


@dataclass(frozen=True)
class _Chunk:
    segment: Segment
    slot: int
    created_ns: int
    stored_bytes: int


def gc(dirs: list[NamespaceDir], *, older_than_s: float | None = None,
       target_bytes: int | None = None, stale: bool = False, gone_s: float | None = None,
       dry_run: bool = False) -> GcReport:
    """Free chunks older than ``older_than_s``, then the oldest until what is stored is at most
    ``target_bytes``; with ``stale``, remove namespaces of another format version, and those
    without metadata that a slot header proves kvtier's; with ``gone_s``, first remove the
    segments (and give back the seats) of writers gone that long (``gone_for``), and give back
    the seats that name no writer with a segment (``_free_seats``)."""
    report = GcReport(dry_run=dry_run)
    chunks = []
    for directory in dirs:
        if directory.unsafe:
            report.skipped_unsafe.append(directory.id)
        elif stale and directory.status in ("stale", "orphaned"):
            _remove_stale(directory, report, dry_run)
        elif directory.readable:
            removed = _remove_gone(directory, gone_s, report, dry_run) if gone_s is not None else set()
            if older_than_s is not None or target_bytes is not None:
                chunks += _namespace_chunks(directory, report, removed)
    chunks.sort(key=lambda c: c.created_ns)
    for segment, mine in _victims(chunks, older_than_s, target_bytes).values():
        try:
            if not dry_run:
                free_slots(segment, [c.slot for c in mine])
        except OSError as exc:
            report.left[segment.label] = [exc.strerror or str(exc)]
            continue
        report.chunks_freed += len(mine)
        report.bytes_freed += sum(c.stored_bytes for c in mine)
    return report


def _remove_gone(directory: NamespaceDir, gone_s: float, report: GcReport,
                 dry_run: bool) -> set[str]:
    """Remove the segments of ``directory`` whose writers are gone for ``gone_s`` seconds,
    and release their seats; return their labels (what a dry run would remove)."""
    gone = []
    for segment in directory.segments:
        try:
            idle = None if segment.unsafe else gone_for(segment)
        except OSError:
            idle = None
        if idle is not None and idle >= gone_s:
            gone.append(segment)
    _free_seats(directory, gone_s, report, dry_run)
    if dry_run or not gone:
        report.segments_removed += [s.label for s in gone]
        return {s.label for s in gone}
    done = Removal()
    try:
        with SafeDir.open(directory.root) as top, top.subdir(directory.id) as handle, \
                handle.subdir(WRITERS_DIR) as writers:
            for segment in gone:
                if remove_segment(segment, writers, done):
                    release_seat(handle, segment.writer)
    except OSError as exc:
        done.left[directory.id] = [exc.strerror or str(exc)]
    report.segments_removed += done.segments_removed
    report.skipped_in_use += done.in_use
    report.left.update(done.left)
    return set(done.segments_removed)


SEAT_GRACE_S = 60.0  # a seat younger than this may be one a writer is setting up elsewhere


def _free_seats(directory: NamespaceDir, gone_s: float, report: GcReport, dry_run: bool) -> None:
    """Give back the seats of ``directory`` that name no writer with a segment, unchanged
    for ``gone_s`` (at least ``SEAT_GRACE_S``): ``orphan_seats``; a dry run lists them."""
    older_than = max(gone_s, SEAT_GRACE_S)
    try:
        with directory.open() as handle:
            if dry_run:
                freed = [name for name, _ in orphan_seats(handle, older_than)]
            else:
                freed = free_orphan_seats(handle, older_than)
    except OSError as exc:
        report.left[f"{directory.id}/{SEATS_DIR}"] = [exc.strerror or str(exc)]
        return
    report.seats_freed += [f"{directory.id}/{SEATS_DIR}/{name}" for name in freed]


def _namespace_chunks(directory: NamespaceDir, report: GcReport,
                      removed: set[str]) -> list[_Chunk]:
    chunks = []
    for segment in directory.segments:
        if segment.label in removed:
            continue
        if segment.unsafe:
            report.skipped_unsafe.append(segment.label)
        elif in_use(segment):
            report.skipped_in_use.append(segment.label)
        else:
            chunks += _chunks(segment, report)
    return chunks


def _chunks(segment: Segment, report: GcReport) -> list[_Chunk]:
    try:
        with segment.open() as handle:
            entries = index_entries(segment, handle, slot_file_sizes(segment.meta, handle))
    except OSError:
        report.skipped_unsafe.append(segment.label)
        return []
    return [_Chunk(segment, slot, h.created_ns, h.payload_bytes)
            for slot, h in entries if h is not None]


def _victims(chunks: list[_Chunk], older_than_s: float | None,
             target_bytes: int | None) -> dict[str, tuple[Segment, list[_Chunk]]]:
    """The chunks to free (oldest first), by segment."""
    victims = []
    if older_than_s is not None:
        cutoff = time.time_ns() - int(older_than_s * 1e9)
        victims = [c for c in chunks if c.created_ns < cutoff]
    if target_bytes is not None:
        kept = chunks[len(victims):]
        stored = sum(c.stored_bytes for c in kept)
        for chunk in kept:
            if stored <= target_bytes:
                break
            victims.append(chunk)
            stored -= chunk.stored_bytes
    by_segment: dict[str, tuple[Segment, list[_Chunk]]] = {}
    for chunk in victims:
        by_segment.setdefault(chunk.segment.label, (chunk.segment, []))[1].append(chunk)
    return by_segment


def _remove_stale(directory: NamespaceDir, report: GcReport, dry_run: bool) -> None:
    try:
        proven = is_proven(directory)
    except OSError:
        proven = False
    if not proven:
        report.skipped_unsafe.append(directory.id)
    elif dry_run:
        if namespace_in_use(directory):
            report.skipped_in_use.append(directory.id)
        else:
            report.namespaces_removed.append(directory.id)
    else:
        done = Removal()
        try:
            remove_namespace(directory, done)
        except OSError as exc:
            done.left[directory.id] = [exc.strerror or str(exc)]
        report.namespaces_removed += done.removed
        report.skipped_in_use += done.in_use
        report.left.update(done.left)
