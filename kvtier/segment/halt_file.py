"""A namespace's halt: sampled checks found wrong KV in it (``verify_halt_after``).

    <disk path>/<namespace id>/halt.json     why hits stopped: made by an engine's scheduler
                                             side, removed by ``kvtier verify --repair`` or
                                             ``kvtier clear`` (or by hand)

While it exists, every engine of the namespace on that directory serves no hit (a fleet
shares the directory, and wrong KV from one writer is wrong for all). Only a regular file of
this user counts: anything else under that name (a symlink, a FIFO, another user's file) is
not kvtier's and is ignored, so no other user can stop an engine's hits with it.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import Any

from kvtier.io.safefs import SafeDir, UnsafeEntry
from kvtier.segment.names import HALT_FILE
from kvtier.segment.slot_files import sync_if_able

HALT_MAX_BYTES = 4096


class HaltFile:
    """The halt file of namespace ``namespace_id`` under ``root`` (a disk path)."""

    def __init__(self, root: str | os.PathLike[str], namespace_id: str) -> None:
        self.root, self.namespace_id = Path(root), namespace_id

    @property
    def path(self) -> Path:
        return self.root / self.namespace_id / HALT_FILE

    def write(self, record: dict[str, Any]) -> None:
        """Make the halt file hold ``record`` (and when) as JSON, durably (synced). ``OSError``
        when it cannot (the namespace's directory does not exist yet, a full disk)."""
        data = json.dumps({**record, "at": time.time()}, sort_keys=True).encode()[:HALT_MAX_BYTES]
        with SafeDir.open(self.root) as top, top.subdir(self.namespace_id) as ns:
            ns.replace_file(HALT_FILE, data)
            fd = ns.open_file(HALT_FILE, os.O_RDONLY)  # synced, and its name: a restart after
            try:  # a power loss still finds the halt
                sync_if_able(fd)
            finally:
                os.close(fd)
            sync_if_able(ns.fd)

    def read(self) -> dict[str, Any] | None:
        """What the halt file says (``{}`` when it is not JSON), or None when there is none
        that counts: missing, not a regular file of this user alone (``UnsafeEntry``), or
        unreadable (offline commands; an engine follows the file with ``look``)."""
        try:
            data = self.look()
        except OSError:
            return None
        if data is None:
            return None
        try:
            record = json.loads(data)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return {}
        return record if isinstance(record, dict) else {}

    def stands(self) -> tuple[bool, OSError | None]:
        """Whether a halt stands (``look``), and, when that cannot be told, why (an engine
        halted before then keeps its halt: offline commands say so, never "no halt")."""
        try:
            return self.look() is not None, None
        except OSError as exc:
            return False, exc

    def look(self) -> bytes | None:
        """The halt file's bytes, or None when there is none: the file, or its namespace's
        directory, does not exist in the disk path (ENOENT). ``OSError`` when it cannot be
        told, and a halt must not end for it: the disk path itself missing or not kvtier's
        (unmounted: the directory beneath, another user's), the namespace's directory not
        kvtier's, something under the file's name that is not a regular file of this user
        alone (a symlink, a FIFO, another user's, a second hard link: ``UnsafeEntry``; such
        a thing starts no halt either), or a read that failed (EIO, ESTALE, EACCES on a
        network filesystem)."""
        with SafeDir.open(self.root) as top:  # any error here: cannot be told
            try:
                with top.subdir(self.namespace_id) as ns:
                    return ns.read_file(HALT_FILE, HALT_MAX_BYTES)
            except OSError as exc:  # gone (the file, or a namespace cleared or never made)
                if exc.errno == errno.ENOENT and not isinstance(exc, UnsafeEntry):
                    return None
                raise

    def remove(self) -> bool:
        """Remove the halt file; False when there was none of this user's."""
        try:
            with SafeDir.open(self.root) as top, top.subdir(self.namespace_id) as ns:
                return ns.remove_file(HALT_FILE)
        except (FileNotFoundError, NotADirectoryError, UnsafeEntry):
            return False

