"""``kvtier clear``, and removing what kvtier wrote: never a segment that a running process
holds, and only what kvtier provably wrote: a namespace whose metadata (or a slot header)
names it, and in it only the files kvtier names, regular files of this user with one link
(a file with more may be linked from outside the cache root: ``SafeDir.remove_file``). Anything
else stays, and is reported.

Reports name a namespace by its id and a segment by its path under the cache root,
``<namespace id>/writers/<writer id>``.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvtier.io.safefs import SafeDir
from kvtier.ops.cache import NamespaceDir, Segment, error_text
from kvtier.ops.clock import NamespaceClock
from kvtier.ops.listing import namespace_names, seat_names, segment_names, writer_names
from kvtier.ops.provenance import removal_refusal
from kvtier.ops.segments import file_problem, hold, note_leases
from kvtier.segment.names import (
    HALT_FILE,
    INDEX_FILE,
    LEASE_FILE,
    LOCK_FILE,
    LOG_FILE,
    META_FILE,
    SEATS_DIR,
    TEMP_NAME,
    WRITER_ID,
    WRITERS_DIR,
    seat_number,
    slot_number,
)
from kvtier.segment.seat_files import linked_temps
from kvtier.segment.seats import release_seat

_SEGMENT_FILES = {INDEX_FILE, LEASE_FILE, LOG_FILE}
_NAMESPACE_FILES = {META_FILE, INDEX_FILE, HALT_FILE}  # with slot files and lock: version 1's layout


@dataclass
class Removal:
    """What removing namespaces did: namespaces and segments removed, segments (or old-layout
    namespaces) in use and left alone, and what was left where, with why: ``left`` names the
    entries left in each place, or why it was left whole, and ``reasons`` says why each
    namespace or segment that the rule of ``provenance`` keeps was left whole; ``problem``
    why the cache root's namespaces were not looked at (more entries than are listed)."""

    removed: list[str] = field(default_factory=list)
    segments_removed: list[str] = field(default_factory=list)
    in_use: list[str] = field(default_factory=list)
    left: dict[str, list[str]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    problem: str = ""

    def keep(self, name: str, why: str) -> None:
        """Record that ``name`` (a namespace or a segment) was left whole, and why."""
        self.left[name] = [why]
        self.reasons[name] = why


def _empty(segment: Segment, ns_dir: SafeDir, handle: SafeDir, done: Removal) -> list[str] | None:
    """``remove_segment``'s removal of the files, its lock held: what is left, or None when
    the segment is left whole (``file_problem``)."""
    unsafe = file_problem(handle)
    if unsafe:
        done.keep(segment.label, unsafe)
        return None
    lock = hold(handle, NamespaceClock(segment.ns))

    def give_back_seat(left: list[str]) -> None:
        # while the lock file is still there and held: a writer coming back under this id
        # waits on it, then claims a seat afresh, rather than finding its old seat (with a
        # lock file made anew) and losing it to this release
        if not left:  # its bytes are gone
            release_seat(ns_dir, segment.writer)

    try:
        return _remove_files(handle, _SEGMENT_FILES, before_lock=give_back_seat)
    finally:
        os.close(lock)


def remove_dir(handle: SafeDir, name: str) -> bool:
    """``SafeDir.remove_dir``, its errors naming the directory by its path."""
    try:
        return handle.remove_dir(name)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot remove {handle.path}/{name}: {exc.strerror}") from None


def _remove_files(handle: SafeDir, kvtier_names: set[str], *, locked: bool = True,
                  before_lock: Callable[[list[str]], None] | None = None,
                  listing: Callable[[SafeDir], list[str]] = segment_names) -> list[str]:
    """Remove the regular files of ``handle`` that kvtier names (``kvtier_names``, slot files,
    its temporary files) and, when the caller holds it (``locked``), the lock file, last,
    after ``before_lock(left)``; return the other entries (``left``). Slot files go first:
    a removal killed midway leaves no slot file whose index is gone (a start-up would scan
    its headers and take back every chunk). ``listing`` lists ``handle`` within its bound
    (past it, ``UnsafeEntry`` and nothing removed)."""
    left = []
    for name in sorted(listing(handle), key=lambda n: slot_number(n) is None):
        if name == LOCK_FILE and locked:
            continue
        mine = (name in kvtier_names or slot_number(name) is not None
                or TEMP_NAME.fullmatch(name) is not None)
        try:
            if not mine or not handle.remove_file(name):
                left.append(name)
        except OSError:  # not a regular file of ours: not kvtier's to delete
            left.append(name)
    if before_lock is not None:
        before_lock(left)
    if locked:
        handle.remove_file(LOCK_FILE)  # held by us: nobody else is using it
    return left


def remove_segment(segment: Segment, ns_dir: SafeDir, writers: SafeDir, done: Removal) -> bool:
    """Remove what kvtier wrote in a segment that is not in use and that ``inspect`` does not
    call unsafe (``file_problem``: else it is left whole, and why goes to ``done``), give back
    its writer's seat (the lock still held, before the directory goes: see
    ``seats.reclaim_segment``), then remove its directory if nothing else is left in it
    (``ns_dir`` is the namespace open, ``writers`` its ``writers/``); record the outcome in
    ``done``; True when the segment is gone. A segment left empty (on NFS, by a removal
    whose lock file was only renamed while held) is removed as it is."""
    try:
        with writers.subdir(segment.writer) as handle:
            left = _empty(segment, ns_dir, handle, done) if segment_names(handle) else []
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            done.in_use.append(segment.label)
        else:
            done.left[segment.label] = [error_text(exc, str(segment.path))]
        return False
    if left is None:
        return False
    if not left and not remove_dir(writers, segment.writer):
        left = ["(entries made while it was being removed)"]
    if left:
        done.left[segment.label] = left
        return False
    done.segments_removed.append(segment.label)
    return True


def _remove_writers(directory: NamespaceDir, handle: SafeDir, done: Removal) -> bool:
    """Remove every segment that can go, then ``writers/`` when it is empty; True when
    there is no ``writers/`` left."""
    if handle.lstat(WRITERS_DIR) is None:
        return True
    gone = True
    with handle.subdir(WRITERS_DIR) as writers:
        for name in writer_names(writers):
            if not WRITER_ID.fullmatch(name):
                done.left.setdefault(f"{directory.id}/{WRITERS_DIR}", []).append(name)
                gone = False
            elif not remove_segment(Segment(directory, name), handle, writers, done):
                gone = False
    if gone and not remove_dir(handle, WRITERS_DIR):
        done.left[f"{directory.id}/{WRITERS_DIR}"] = ["(entries made while it was being removed)"]
        gone = False
    return gone


def _remove_seats(handle: SafeDir) -> None:
    """With no segment left, every seat is free: remove the seat files, then ``seats/``
    (anything else in it stays, and so does the directory; past its bound, ``UnsafeEntry``
    and nothing removed)."""
    if handle.lstat(SEATS_DIR) is None:
        return
    with handle.subdir(SEATS_DIR) as seats:
        names = seat_names(seats)
        linked = linked_temps(seats, names)  # a crash's temporary file linked to its seat goes first
        for name in sorted(linked) + [n for n in names if n not in linked]:
            if seat_number(name) is not None or TEMP_NAME.fullmatch(name):
                try:
                    seats.remove_file(name, links=2 if name in linked else 1)
                except OSError:
                    continue  # not a regular file of ours: not kvtier's to delete
        empty = not seats.scan(1)
    if empty:
        remove_dir(handle, SEATS_DIR)


def remove_namespace(directory: NamespaceDir, done: Removal) -> None:
    """Remove what kvtier wrote in a namespace: its segments that are not in use, then, when
    no segment is left, its own files (a lock file there, of the layout of another format
    version, is held meanwhile; one in use leaves the namespace alone) and the directory if
    nothing else is left in it. The outcome goes to ``done``."""
    with SafeDir.open(directory.root) as top, top.subdir(directory.id) as handle:
        had_lock = handle.lstat(LOCK_FILE) is not None
        old_layout = directory.status != "ok" or had_lock
        try:
            lock = hold(handle, NamespaceClock(directory)) if old_layout else -1
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            done.in_use.append(directory.id)
            return
        left = None
        try:
            if handle.lstat(SEATS_DIR) is not None:  # each segment removed gives its seat back:
                with handle.subdir(SEATS_DIR) as seats:  # past its bound, nothing is removed
                    seat_names(seats)
            if not _remove_writers(directory, handle, done):
                return  # namespace.json stays: it describes the segments left
            _remove_seats(handle)
            left = _remove_files(handle, _NAMESPACE_FILES, locked=lock >= 0,
                                 listing=namespace_names)
        finally:
            if lock >= 0 and left is None and not had_lock:  # the lock file it made goes
                with contextlib.suppress(OSError):  # again with the namespace left
                    handle.remove_file(LOCK_FILE)
            if lock >= 0:
                os.close(lock)
        if not left and not remove_dir(top, directory.id):
            left = ["(entries made while it was being removed)"]
    if left:
        done.left[directory.id] = left
    else:
        done.removed.append(directory.id)


def clear(dirs: list[NamespaceDir]) -> Removal:
    """Remove whole namespaces that kvtier provably wrote (in each, the segments that are not
    in use and not unsafe); the others (``provenance.removal_refusal``) are left alone with
    the reason. The leases other machines' writers left open are watched from the start, once
    for all (``note_leases``)."""
    done = Removal()
    note_leases(dirs)
    for directory in dirs:
        try:
            refusal = removal_refusal(directory)
            if refusal:
                done.keep(directory.id, refusal)
                continue
            remove_namespace(replace(directory, proven=True), done)
        except OSError as exc:
            done.left[directory.id] = [error_text(exc, str(directory.path))]
    return done
