"""Listing the other writers' segments of a namespace on one path: the valid writer ids
under ``writers/`` that are directories, at most as many as a reader may follow, segments
first: a directory holding none of a segment's files never takes a segment's place."""

from __future__ import annotations

import errno
import logging
import resource
import stat
from collections.abc import Sequence

from kvtier.io.mounts import holding_mounts, is_mounted, mount_points
from kvtier.io.safefs import SafeDir
from kvtier.segment.names import INDEX_FILE, LEASE_FILE, LOG_FILE, WRITER_ID, WRITERS_DIR
from kvtier.shared.followed import FILES_PER_WRITER, MAX_WRITERS

log = logging.getLogger("kvtier")
MAX_LISTED = 16 * MAX_WRITERS  # entries of a ``writers/`` listed per refresh; more are not
_SHORT_OF_FILES = {errno.EMFILE, errno.ENFILE, errno.ENOMEM}  # this process's trouble, not the path's
_SEGMENT_FILES = (LOG_FILE, LEASE_FILE, INDEX_FILE)  # a segment holds one of them at least


class WriterListing:
    """The writers' segments of namespace ``ns_id`` under ``roots``.

    Contract: ``names(path, own)`` returns at most ``max_writers`` directories of
    ``writers/`` with a valid writer id other than ``own`` (None: any), by name (sorted) with their
    inodes. Segments (a directory holding a regular ``log.kvt``, ``lease`` or ``index.kvt``)
    come first; other directories (empty, or junk) only fill the places segments leave, so
    that a segment of theirs left by a writer that crashed while making it is still followed
    and reclaimed. What a directory is, is looked at again only when its inode or
    modification time changed (a writer's heartbeat renames its lease into it)."""

    def __init__(self, roots: Sequence[str], ns_id: str, max_writers: int) -> None:
        self._roots, self._ns_id, self.max_writers = roots, ns_id, max_writers
        self._capped = False  # whether leaving writers unfollowed was said
        self._said_mounted: set[str] = set()  # mount points passed over, said once each
        self._kinds: list[dict[str, tuple[int, int, bool]]] = [{} for _ in roots]

    def names(self, path: int, own: str | None) -> dict[str, int] | None:
        """The segments on path ``path`` of writers other than ``own``, by name, with their directories'
        inodes, at most ``max_writers`` (none when the path cannot be read; None when this
        process is out of files or memory, which says nothing about the path)."""
        points = mount_points()  # never looked at: a hung mount holds whoever looks
        try:
            with SafeDir.open(self._roots[path]) as top:
                if is_mounted(points, top.fd, self._ns_id):
                    return self._mounted(path, self._ns_id)
                with top.subdir(self._ns_id) as ns_dir:
                    if is_mounted(points, ns_dir.fd, WRITERS_DIR):
                        return self._mounted(path, WRITERS_DIR)
                    with ns_dir.subdir(WRITERS_DIR) as writers:
                        names = sorted(name for name in writers.scan(MAX_LISTED)
                                       if name != own and WRITER_ID.fullmatch(name))
                        names = self._unmounted(path, points, writers, names)
                        segments, others = self._sorted_out(path, writers, names)
        except OSError as exc:
            return None if exc.errno in _SHORT_OF_FILES else {}
        if len(segments) > self.max_writers:
            self._say_capped(path)
        chosen = segments[:self.max_writers] + others[:max(0, self.max_writers - len(segments))]
        return dict(sorted(chosen))

    def _sorted_out(self, path: int, writers: SafeDir, names: list[str],
                    ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """(segments, other directories) among ``names``, as (name, inode); no more
        segments than one past ``max_writers`` (enough to tell that some are left out)."""
        segments: list[tuple[str, int]] = []
        others: list[tuple[str, int]] = []
        kinds, known = {}, self._kinds[path]
        for name in names:
            info = writers.lstat(name)
            if info is None or not stat.S_ISDIR(info.st_mode):
                continue  # junk is passed over before the cap, never counted in it
            kind = known.get(name)
            if kind is None or kind[:2] != (info.st_ino, info.st_mtime_ns):
                kind = (info.st_ino, info.st_mtime_ns, _is_segment(writers, name))
            kinds[name] = kind
            (segments if kind[2] else others).append((name, info.st_ino))
            if len(segments) > self.max_writers:
                break
        self._kinds[path] = kinds
        return segments, others

    def _unmounted(self, path: int, points: frozenset[str], writers: SafeDir,
                   names: list[str]) -> list[str]:
        """``names`` less the mount points among them and those holding one (a file system
        mounted on a file of a segment: its reads, or its close, may never end), each said
        once."""
        mounted, kept = holding_mounts(points, writers.fd), []
        for name in names:
            if name in mounted:
                self._mounted(path, name)
            else:
                kept.append(name)
        return kept

    def _mounted(self, path: int, name: str) -> dict[str, int]:
        """A mount point where a directory of the namespace is expected: passed over (said
        once), nothing of it followed: the answer of ``names`` for it ({})."""
        if name not in self._said_mounted:
            self._said_mounted.add(name)
            log.warning("kvtier: %s under %s is or holds a mount point: not followed (a file "
                        "system mounted in a shared cache directory could hold every read of it)",
                        name, self._roots[path])
        return {}

    def _say_capped(self, path: int) -> None:
        if not self._capped:
            self._capped = True
            log.warning("kvtier: following only %d other writers on %s: each takes %d open "
                        "files, and the open-file limit (ulimit -n) is %d; raise it to read "
                        "every writer's chunks", self.max_writers, self._roots[path],
                        FILES_PER_WRITER, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _is_segment(writers: SafeDir, name: str) -> bool:
    """Whether directory ``name`` of ``writers/`` holds a segment's file (a regular file
    named as kvtier names its log, lease or index); nothing is opened but the directory."""
    try:
        with writers.subdir(name) as directory:
            for file in _SEGMENT_FILES:
                info = directory.lstat(file)
                if info is not None and stat.S_ISREG(info.st_mode):
                    return True
    except OSError:
        pass  # unsafe or vanished: not a segment this reader can follow
    return False
