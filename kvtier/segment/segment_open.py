"""Opening one writer's segment directory of a namespace: its seat claimed, ``namespace.json``
written, and refused where another process of this host holds the segment."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

from kvtier.io.safefs import CacheDirError, SafeDir
from kvtier.segment.lock import locked_here
from kvtier.segment.names import META_FILE, WRITERS_DIR
from kvtier.segment.seats import claim_seat

MAX_META_BYTES = 1 << 20  # namespace.json is a few hundred bytes; anything larger is not ours

OWN_ID_HINT = "give each instance its own instance_id (or let kvtier derive one)"


def open_segment(root: Path, namespace_id: str, writer: str, meta: dict,
                 share_writers: int) -> SafeDir:
    """The segment directory of ``writer`` in namespace ``namespace_id`` under ``root``,
    made (mode 0700) when missing, once ``writer`` holds one of the namespace's
    ``share_writers`` seats (``claim_seat``); ``namespace.json`` is written when it does not
    already say ``meta`` (every writer of a namespace writes the same)."""
    text = json.dumps(meta, indent=2, sort_keys=True).encode()
    with SafeDir.open(root) as top, top.subdir(namespace_id, create=True) as ns_dir:
        try:
            same = ns_dir.read_file(META_FILE, MAX_META_BYTES) == text
        except OSError:
            same = False  # not ours, or unreadable: replace it
        if not same:
            ns_dir.replace_file(META_FILE, text)
        with ns_dir.subdir(WRITERS_DIR, create=True) as writers:
            if writers.lstat(writer) is not None:
                with writers.subdir(writer) as segment:
                    refuse_if_locked(segment)  # another process's id: before any seat is looked at
            claim_seat(ns_dir, writer, share_writers)
            segment = writers.subdir(writer, create=True)
            for parent in (writers, ns_dir, top):  # the new names durable, as the files' syncs
                with contextlib.suppress(OSError):  # a filesystem that cannot: its own rule
                    os.fsync(parent.fd)
            return segment


def refuse_if_locked(segment: SafeDir) -> None:
    """``CacheDirError`` (EBUSY) when another process holds ``segment``'s lock (a writer of
    this host writes it); nothing is taken. A lock that cannot be looked at is left to
    ``lock_namespace`` to report."""
    if locked_here(segment):
        raise CacheDirError(errno.EBUSY, f"{segment.path} is in use by another kvtier process; "
                            f"{OWN_ID_HINT}")
