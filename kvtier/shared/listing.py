"""Listing the other writers' segments of a namespace on one path: the valid writer ids
under ``writers/`` that are directories, at most as many as a reader may follow."""

from __future__ import annotations

import errno
import logging
import resource
import stat
from collections.abc import Sequence

from kvtier.io.safefs import SafeDir
from kvtier.segment.names import WRITER_ID, WRITERS_DIR
from kvtier.shared.followed import FILES_PER_WRITER, MAX_WRITERS

log = logging.getLogger("kvtier")
MAX_LISTED = 16 * MAX_WRITERS  # entries of a ``writers/`` listed per refresh; more are not
_SHORT_OF_FILES = {errno.EMFILE, errno.ENFILE, errno.ENOMEM}  # this process's trouble, not the path's


class WriterListing:
    """The writers' segments of namespace ``ns_id`` under ``roots``."""

    def __init__(self, roots: Sequence[str], ns_id: str, max_writers: int) -> None:
        self._roots, self._ns_id, self.max_writers = roots, ns_id, max_writers
        self._capped = False  # whether leaving writers unfollowed was said

    def names(self, path: int, own: str) -> dict[str, int] | None:
        """The segments on path ``path`` of writers other than ``own``, by name, with their directories'
        inodes, at most ``max_writers`` (none when the path cannot be read; None when this
        process is out of files or memory, which says nothing about the path)."""
        try:
            with SafeDir.open(self._roots[path]) as top, top.subdir(self._ns_id) as ns_dir, \
                    ns_dir.subdir(WRITERS_DIR) as writers:
                names = sorted(name for name in writers.scan(MAX_LISTED)
                               if name != own and WRITER_ID.fullmatch(name))
                found: dict[str, int] = {}
                for name in names:  # junk is passed over before the cap, never counted in it
                    info = writers.lstat(name)
                    if info is not None and stat.S_ISDIR(info.st_mode):
                        if len(found) == self.max_writers:
                            self._say_capped(path)
                            break
                        found[name] = info.st_ino
                return found
        except OSError as exc:
            return None if exc.errno in _SHORT_OF_FILES else {}

    def _say_capped(self, path: int) -> None:
        if not self._capped:
            self._capped = True
            log.warning("kvtier: following only %d other writers on %s: each takes %d open "
                        "files, and the open-file limit (ulimit -n) is %d; raise it to read "
                        "every writer's chunks", self.max_writers, self._roots[path],
                        FILES_PER_WRITER, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
