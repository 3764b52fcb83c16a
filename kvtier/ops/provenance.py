"""What kvtier can prove it wrote: the one rule every command that deletes applies, and the
judgement ``kvtier inspect`` shows.

A namespace may be removed only when it is not unsafe, its ``namespace.json`` is not damaged
(metadata that does not check out is never a reason to delete: it may be someone else's
file, or a fault to look at), and kvtier provably wrote it: its ``namespace.json`` is
trusted, or (without one) a slot header names it. A segment may be emptied only when none of
the files kvtier names in it is unsafe (``segments.file_problem``: a symlink, a special
file, another user's, hard-linked, or a lease larger than kvtier writes), as ``inspect``
calls it unsafe and ``gc`` leaves it alone.
"""

from __future__ import annotations

import os

from kvtier.io.format import HEADER_BYTES, HeaderError, decode_header
from kvtier.io.safefs import SafeDir, read_at
from kvtier.ops.cache import NamespaceDir, error_text, slot_files

NOT_PROVEN = "no namespace.json, and no slot header proves it kvtier's"


def proven_by_slots(directory: SafeDir, digest: bytes) -> bool:
    """True when a slot file in ``directory`` starts with a checked header of ``digest``."""
    for name in slot_files(directory).values():
        try:
            fd = directory.open_file(name, os.O_RDONLY)
        except OSError:
            continue
        try:
            header = decode_header(read_at(fd, HEADER_BYTES, 0))
        except (HeaderError, OSError):
            continue
        finally:
            os.close(fd)
        if header.namespace == digest:
            return True
    return False


def is_proven(ns: NamespaceDir) -> bool:
    """True when kvtier provably wrote this namespace: trusted metadata, or a slot (in the
    namespace directory or in a safe segment) whose checked header names it."""
    if ns.meta is not None:
        return True
    if ns.unsafe:
        return False
    digest = bytes.fromhex(ns.id)
    with ns.open() as directory:
        if proven_by_slots(directory, digest):
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
