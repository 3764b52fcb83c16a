"""``kvtier verify``: check every slot's header and payload, segment by segment; optionally
free the bad ones.

Only the segments of a namespace whose ``namespace.json`` is trusted are read (its geometry
checked against the chunk size), each only as far as its files can hold slots, and holes in
the files (slots freed by ``gc``, never written) are skipped without reading. ``--repair``
changes nothing when a slot shows that the metadata disagrees with the slots (a good header
of this namespace for another chunk size): blanking then would destroy good chunks, nor in a
segment in use. A good slot that the index does not name is indexed, unless its entry is the
slot's tombstone (``kvtier.io.format.mark_removed``): a removal killed between its entry and
its header, which a repair finishes (the header blanked) rather than bring the chunk back.

A segment in use is being written while it is read: its slots that look bad are read again
after a pause, and only those still bad the same way count (``kvtier.ops.recheck``).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvtier.io.format import HEADER_BYTES, INDEX_ENTRY_BYTES, SlotHeader, decode_header, removed_from
from kvtier.io.safefs import CacheDirError, SafeDir
from kvtier.ops.cache import NamespaceDir, Segment, error_text, halt_unknown, slot_file_sizes, slot_files
from kvtier.ops.clock import NamespaceClock
from kvtier.ops.index_cursor import IndexCursor, Named
from kvtier.ops.recheck import read_again, seen_of
from kvtier.ops.segments import busy_reason, file_problem, hold, index_entries, index_tombstones, rewrite_log
from kvtier.ops.slot_reads import Look, open_slot_file, slots_of_file
from kvtier.segment.cachedir import INDEX_FILE
from kvtier.segment.halt_file import HaltFile


@dataclass
class VerifyReport:
    """What one writer's segment holds, slot by slot (slots numbered within the segment)."""

    writer: str
    slots: int = 0
    ok: int = 0
    free: int = 0
    corrupt: list[int] = field(default_factory=list)  # header fine, payload wrong or short
    torn: list[int] = field(default_factory=list)  # header does not check out
    foreign: list[int] = field(default_factory=list)  # another namespace's slot
    mismatched: list[int] = field(default_factory=list)  # this namespace, another chunk size
    unindexed: list[int] = field(default_factory=list)  # good slot the index names not, or wrongly
    removed: list[int] = field(default_factory=list)  # good slot its index entry says was removed
    stale_index: list[int] = field(default_factory=list)  # index names a slot that is not there
    problem: str = ""  # why the segment could not be verified (or repaired) at all
    in_use: bool = False  # a process holds it (see kvtier.ops.segments): read, never repaired
    repaired: int = 0  # slots --repair changed: blanked, or their index entry fixed

    @property
    def problems(self) -> int:
        return (len(self.corrupt) + len(self.torn) + len(self.foreign) + len(self.mismatched)
                + len(self.unindexed) + len(self.removed) + len(self.stale_index)
                + bool(self.problem))

    def as_dict(self) -> dict:
        return {**asdict(self), "problems": self.problems}


@dataclass
class NamespaceVerify:
    """Every segment of one namespace verified, or why the namespace could not be read."""

    id: str
    problem: str = ""
    writers: list[VerifyReport] = field(default_factory=list)
    halted: bool = False  # sampled checks found wrong KV while serving: no hits (halt.json)
    halt_removed: bool = False  # --repair removed the halt: engines serve hits again
    clock_problem: str = ""  # why the filesystem's clock was not read, when it was needed

    @property
    def problems(self) -> int:
        return sum(w.problems for w in self.writers) + bool(self.problem) + \
            (self.halted and not self.halt_removed)

    def as_dict(self) -> dict:
        total = {name: sum(getattr(w, name) for w in self.writers)
                 for name in ("slots", "ok", "free", "repaired")}
        return {"id": self.id, "problems": self.problems, **total, "problem": self.problem,
                "halted": self.halted, "halt_removed": self.halt_removed,
                "clock_problem": self.clock_problem, "writers": [w.as_dict() for w in self.writers]}


@dataclass
class _Scan:
    """What one pass over the slots found, and what repairing would write."""

    names: dict[int, str]  # the slot files, listed once: every read and write goes by this
    tombstones: dict[int, bytes] = field(default_factory=dict)  # index entries of removals
    blanks: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, file number, offset)
    fixes: list[tuple[int, bytes | None]] = field(default_factory=list)  # index: entry or blank
    suspects: dict[int, tuple] = field(default_factory=dict)  # bad slots: ``seen_of``, first read

    def suspect(self, slot: int, seen: Look, named: Named) -> None:
        self.suspects[slot] = seen_of(seen, named)


_PROBLEMS = ("corrupt", "torn", "foreign", "mismatched", "unindexed", "removed", "stale_index")


def verify_namespace(ns: NamespaceDir, repair: bool = False,
                     progress: Callable[[int], None] | None = None) -> NamespaceVerify:
    """``verify_segment`` of every segment of ``ns`` (none, and the ``problem``, when the
    namespace cannot be read at all); whether engines halted its hits (``halt_file``), and
    with ``repair`` the halt removed: the operator has looked at the cache."""
    if not ns.readable:
        return NamespaceVerify(ns.id, f"{ns.status}: {ns.problem or 'another format version'}")
    halt, where = HaltFile(ns.root, ns.id), str(ns.root / ns.id / "halt.json")
    halted, unknown = halt.stands()
    report = NamespaceVerify(ns.id, halted=halted)
    if unknown is not None:
        report.problem = halt_unknown(unknown, where)
    if repair and report.halted and not ns.unsafe:
        try:
            report.halt_removed = halt.remove()
        except OSError as exc:  # a read-only mount, or a directory not ours to write
            report.problem = f"halt.json not removed: {error_text(exc, where)}"
    clock = NamespaceClock(ns)
    for segment in ns.segments:
        try:
            report.writers.append(verify_segment(segment, repair, progress, clock))
        except OSError as exc:
            report.writers.append(VerifyReport(segment.writer, problem=error_text(exc, str(segment.path))))
    report.clock_problem = clock.problem
    return report


def verify_segment(segment: Segment, repair: bool = False,
                   progress: Callable[[int], None] | None = None,
                   clock: NamespaceClock | None = None) -> VerifyReport:
    """Read every slot of ``segment``; with ``repair`` blank bad slots and wrong index
    entries, index good slots the index missed, finish removals cut short (a good slot whose
    entry is its tombstone: its header blanked), and start the segment's log afresh from the
    repaired index. A segment in use is read but not repaired (``in_use``; with ``repair``,
    ``problem`` says it was not repaired); an unsafe one (``file_problem``) is not read.
    ``clock``: its namespace's (``NamespaceClock``), read for a lease another machine left
    open."""
    report = VerifyReport(segment.writer)
    clock = NamespaceClock(segment.ns) if clock is None else clock
    if segment.unsafe:
        report.problem = f"unsafe: {segment.problem}"
        return report
    with segment.open() as directory:
        unsafe = file_problem(directory)  # as inspect says: nothing in it is read or changed
        if unsafe:
            report.problem = f"unsafe: {unsafe}"
            return report
        if repair:  # in use: not repaired, and the problem says so
            lock = _hold_for_repair(directory, report, clock)
        else:
            lock, report.in_use = -1, bool(busy_reason(directory, clock))
        try:
            scan = _scan(segment, directory, report, progress)
            if report.in_use and scan.suspects:
                _recheck(segment, directory, scan, report)
            if repair and not report.in_use:  # in use: the problem says it was not repaired
                _repair(segment, directory, scan, report)
        finally:
            if lock >= 0:
                os.close(lock)
    return report


def _repair(segment: Segment, directory: SafeDir, scan: _Scan, report: VerifyReport) -> None:
    if report.mismatched:
        report.problem = ("slots of this namespace hold another chunk size than "
                          "namespace.json says: not repaired (it would blank good chunks)")
        return
    report.repaired = _apply(directory, scan)
    if report.repaired:
        sizes = slot_file_sizes(segment.meta, directory, scan.names)
        report.problem = rewrite_log(segment, directory, sizes)


def _hold_for_repair(directory: SafeDir, report: VerifyReport, clock: NamespaceClock) -> int:
    """The segment's lock, or -1 with ``report`` saying it is in use."""
    try:
        return hold(directory, clock)
    except CacheDirError as exc:
        if exc.errno != errno.EBUSY:
            raise
        report.in_use, report.problem = True, f"not repaired: {error_text(exc, directory.path)}"
        return -1


def _scan(segment: Segment, directory: SafeDir, report: VerifyReport,
          progress: Callable[[int], None] | None) -> _Scan:
    """One pass over the segment's slot files in slot order, its index walked alongside
    (``IndexCursor``: no entry held but the slot's own)."""
    scan = _Scan(slot_files(directory))
    sizes = slot_file_sizes(segment.meta, directory, scan.names)
    scan.tombstones = index_tombstones(segment, directory, sizes)
    stride, per_file = segment.meta.stride, segment.meta.file_slots
    with contextlib.closing(index_entries(segment, directory, sizes)) as entries:
        index = IndexCursor(entries)
        for number, size in sizes.items():
            fd = open_slot_file(directory, scan.names[number], os.O_RDONLY)
            try:
                for local, (verdict, entry) in slots_of_file(fd, size // stride, segment.meta,
                                                             segment.digest):
                    if isinstance(local, range):  # a hole: free slots, never read
                        report.slots += len(local)
                        report.free += len(local)
                        first = number * per_file
                        _stale(report, index.within(first + local.start, first + local.stop), scan)
                        if progress:
                            progress(len(local))
                        continue
                    slot = number * per_file + local
                    report.slots += 1
                    if _classify(report, slot, (verdict, entry), index.at(slot), scan):
                        scan.blanks.append((slot, number, local * stride))
                    if progress:
                        progress(1)
            finally:
                os.close(fd)
        _stale(report, index.rest(), scan)  # the index names slots past the end of the files
    return scan


def _recheck(segment: Segment, directory: SafeDir, scan: _Scan, report: VerifyReport) -> None:
    """Read the slots of a segment in use that looked bad again (``read_again``), and forget
    those not bad the same way (a write or removal was under way); one that did not count as
    ok or free is counted as the second read found it."""
    again = read_again(segment, directory, scan.names, sorted(scan.suspects))
    passed = {slot for slot, first in scan.suspects.items() if again[slot] != first}
    for name in _PROBLEMS:
        setattr(report, name, [slot for slot in getattr(report, name) if slot not in passed])
    for slot in passed:
        first, now = scan.suspects[slot][0][0], again[slot][0][0]
        if first not in ("ok", "free") and now in ("ok", "free"):
            setattr(report, now, getattr(report, now) + 1)
    scan.blanks = [blank for blank in scan.blanks if blank[0] not in passed]
    scan.fixes = [fix for fix in scan.fixes if fix[0] not in passed]


def _stale(report: VerifyReport, entries: list[tuple[int, SlotHeader | None]], scan: _Scan) -> None:
    """Index entries of slots that hold nothing (free, or past the end of the files)."""
    for slot, header in entries:
        report.stale_index.append(slot)
        scan.fixes.append((slot, None))
        scan.suspect(slot, ("free", b""), (True, header))


def _classify(report: VerifyReport, slot: int, seen: Look, named: Named, scan: _Scan) -> bool:
    """Count one slot read; True when a repair blanks its header."""
    verdict, entry = seen
    if verdict == "free":
        report.free += 1
    elif verdict == "ok":
        report.ok += 1
        if removed_from(scan.tombstones.get(slot), entry):  # a removal killed between the
            report.removed.append(slot)  # entry's tombstone and the header's blanking:
            scan.suspect(slot, seen, named)  # finished, never indexed again
            return True
        if named[1] != decode_header(entry):  # none, or another chunk's (a crash
            report.unindexed.append(slot)  # between the slot's write and its entry's)
            scan.fixes.append((slot, entry))
            scan.suspect(slot, seen, named)
        return False
    else:
        getattr(report, verdict).append(slot)
        scan.suspect(slot, seen, named)
    if named[0]:  # the index names a slot that holds nothing good
        if verdict == "free":
            report.stale_index.append(slot)
            scan.suspect(slot, seen, named)
        scan.fixes.append((slot, None))
    return verdict in ("corrupt", "torn", "foreign")


def _apply(directory: SafeDir, scan: _Scan) -> int:
    """Blank the bad slots' headers and rewrite the index entries; the count of slots
    changed (each once, whether blanked, its entry fixed, or both)."""
    files: dict[int, int] = {}
    try:
        for _, number, offset in scan.blanks:
            if number not in files:
                files[number] = open_slot_file(directory, scan.names[number], os.O_RDWR)
            os.pwrite(files[number], bytes(HEADER_BYTES), offset)
    finally:
        for fd in files.values():
            os.close(fd)
    fd = directory.open_file(INDEX_FILE, os.O_RDWR, create=True)
    try:
        for slot, entry in scan.fixes:
            os.pwrite(fd, entry or bytes(INDEX_ENTRY_BYTES), slot * INDEX_ENTRY_BYTES)
    finally:
        os.close(fd)
    return len({slot for slot, _, _ in scan.blanks} | {slot for slot, _ in scan.fixes})
