"""What kvtier can prove it wrote: the one rule every command that deletes applies, and the
judgement ``kvtier inspect`` shows.

A namespace may be removed only when it is not unsafe, its ``namespace.json`` is not damaged
(metadata that does not check out is never a reason to delete: it may be someone else's
file, or a fault to look at), and kvtier provably wrote it: its ``namespace.json`` is
trusted, or (without one) a checked slot header or index entry names it
(``proven_by_slots``). A segment may be emptied only when none of the files kvtier names in
it is unsafe (``segments.file_problem``: a symlink, a special file, another user's,
hard-linked, or a lease larger than kvtier writes), as ``inspect`` calls it unsafe and
``gc`` leaves it alone.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable

from kvtier.io.format import HEADER_BYTES, HeaderError, decode_header
from kvtier.io.safefs import SafeDir, read_at
from kvtier.ops.cache import NamespaceDir, error_text, slot_files
from kvtier.ops.listing import namespace_names
from kvtier.ops.slot_reads import next_data
from kvtier.segment.index_file import MAX_SLOTS, written_index_entries

NOT_PROVEN = "no namespace.json, and no slot header or index entry proves it kvtier's"
PROOF_REGIONS = 64  # stretches of data of a slot file looked into for a header, at most
PROOF_ENTRIES = 64  # index entries that are not blank looked at, at most


def proven_by_slots(directory: SafeDir, digest: bytes, names: list[str] | None = None) -> bool:
    """True when a slot file in ``directory`` holds a checked header of ``digest`` where one
    of its first ``PROOF_REGIONS`` stretches of data starts (a slot freed by ``gc`` is a
    hole: the next slot holding a chunk starts the next stretch), or its ``index.kvt`` a
    checked entry of ``digest`` among its first ``PROOF_ENTRIES`` that are not blank. Only
    regular files of this user are read (``SafeDir.open_file``), 4 KiB at a time. ``names``:
    the directory's listing (by default a segment's: ``slot_files``)."""
    for name in slot_files(directory, names).values():
        if _file_proves(directory, name, lambda fd: _header_proves(fd, digest)):
            return True
    return _index_proves(directory, digest)


def _file_proves(directory: SafeDir, name: str, proves: Callable[[int], bool]) -> bool:
    try:
        fd = directory.open_file(name, os.O_RDONLY)
    except OSError:
        return False
    try:
        return proves(fd)
    except OSError:
        return False
    finally:
        os.close(fd)


def _header_proves(fd: int, digest: bytes) -> bool:
    offset = 0
    for _ in range(PROOF_REGIONS):
        start = next_data(fd, offset)
        if start is None:
            return False
        start -= start % HEADER_BYTES  # slots start on 4 KiB boundaries
        if _names(read_at(fd, HEADER_BYTES, start), digest):
            return True
        hole = _next_hole(fd, start + HEADER_BYTES)
        if hole is None:
            return False
        offset = hole
    return False


def _next_hole(fd: int, offset: int) -> int | None:
    """Where the stretch of data at ``offset`` ends; None past the end of the file, or
    where the filesystem cannot say (all of the file is data)."""
    try:
        return os.lseek(fd, offset, os.SEEK_HOLE)
    except OSError:
        return None


def _index_proves(directory: SafeDir, digest: bytes) -> bool:
    try:
        with contextlib.closing(written_index_entries(directory, MAX_SLOTS)) as entries:
            return any(_names(entry, digest)
                       for _, entry in itertools.islice(entries, PROOF_ENTRIES))
    except OSError:
        return False


def _names(data: bytes, digest: bytes) -> bool:
    """True when ``data`` starts with a checked kvtier header (or index entry) of ``digest``."""
    try:
        return decode_header(data).namespace == digest
    except HeaderError:
        return False


def is_proven(ns: NamespaceDir) -> bool:
    """True when kvtier provably wrote this namespace: trusted metadata, or a slot (in the
    namespace directory or in a safe segment) whose checked header names it."""
    if ns.meta is not None:
        return True
    if ns.unsafe:
        return False
    digest = bytes.fromhex(ns.id)
    with ns.open() as directory:  # format version 1's slot files lie there
        if proven_by_slots(directory, digest, namespace_names(directory)):
            return True
    for segment in ns.segments:
        if segment.unsafe:
            continue
        try:
            with segment.open() as directory:
                if proven_by_slots(directory, digest):
                    return True
        except OSError:
            continue
    return False


def damaged_reason(ns: NamespaceDir) -> str:
    """Why a namespace whose ``namespace.json`` is damaged is left alone."""
    return f"damaged ({ns.problem}): left alone; inspect shows why"


def removal_refusal(ns: NamespaceDir) -> str:
    """Why no command may remove ``ns`` ("" when one may; see the module docstring): it is
    unsafe (the entry named), its metadata is damaged, or nothing proves it kvtier's."""
    if ns.unsafe:
        return ns.problem or f"{ns.path} is unsafe; inspect shows why"
    if ns.status == "damaged":
        return damaged_reason(ns)
    try:
        return "" if is_proven(ns) else NOT_PROVEN
    except OSError as exc:
        return error_text(exc, str(ns.path))
