"""The disk paths of a disk tier and their health: each path's open directory or why it is
out of service, taking a path out when it fails for good, and trying it again later."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Sequence

from kvtier.disk.opening import OpenArgs
from kvtier.disk.path_opener import PathOpener
from kvtier.io.answers import answers, ask
from kvtier.io.mounts import fell_through, mount_point_of
from kvtier.io.result import IOResult, IOStatus
from kvtier.segment.cachedir import CacheDir
from kvtier.segment.lease import Lease, LeaseLost
from kvtier.segment.lease_keeper import LeaseKeeper

log = logging.getLogger("kvtier.disk.tier")  # these are the disk tier's messages

_PATH_FATAL = {errno.EROFS, errno.ENOENT, errno.EACCES, errno.EPERM, errno.EBADF, errno.ENODEV,
               errno.ENXIO, errno.ESTALE, errno.ENOTDIR}
_EIO_LIMIT = 3  # consecutive I/O errors that take a path out of service
_RETRY_MAX_S = 600.0  # the longest wait between two tries of a path out of service


class PathState:
    """One disk path's state: its directory (``None`` while out of service, with
    ``down_reason``), its run of I/O errors and its retry schedule.

    The tier reads ``dir`` once per request and uses that directory throughout (another
    thread may take the path down meanwhile), and sets ``eio_run`` to 0 after each request
    that succeeded; everything else changes only through :class:`DiskPaths`.
    """

    def __init__(self, root: str, retry: float | None) -> None:
        self.root = root
        self.dir: CacheDir | None = None
        self.down_reason = ""
        self.eio_run = 0
        self.inode = 0
        self.checked_at = 0.0
        self.stale: CacheDir | None = None  # taken down; closed before the path is reopened
        self.retry_at = 0.0
        self.retry_every = retry  # None: never tried again
        self.retry_first = retry
        self.back_at = 0.0  # when it last came back into service
        self.mount_point: str | None = None  # where its file system was mounted at start or open
        self.read_back = False  # what it holds was read back since the start (``DiskRetries``)

    @property
    def own(self) -> str | None:
        """The writer id of the segment this store holds on the path (its lock and seat):
        the directory in service, or the one taken out and kept open until the next try;
        None while it holds none (its id is then nobody's here: ``DiskPaths.own``)."""
        held = self.dir if self.dir is not None else self.stale
        return None if held is None or held.closed else held.writer


class DiskPaths:
    """The paths of one tier, each opened at start (a path that cannot be opened, or whose
    open does not end in time: ``PathOpener``, starts out of service), and the rules that
    take a path out of service and bring it back.

    Contract: a path goes down on a fatal error (read-only, gone, no permission, ...), on
    ``_EIO_LIMIT`` I/O errors or timeouts in a row, or when its directory is no longer the
    one opened (checked every ``check_every`` seconds); ENOSPC never takes it down. A
    failure seen on a directory that is no longer the path's says nothing about the path.
    A path that is down stays down until ``revive`` reopens it; its old files stay open
    until then (a request may still be using them) or until ``close``. Tries of a path are
    ``retry`` seconds apart at first and double on each try up to ten minutes (or ``retry``
    when longer), so a path that keeps failing is tried less and less; ``retry`` None means
    a path that went down is never tried again. Thread-safe.
    """

    def __init__(self, roots: Sequence[str], retry: float | None, opener: OpenArgs,
                 check_every: float, beat_every: float) -> None:
        self.states = [PathState(root, retry) for root in roots]
        self._opener, self._check_every = PathOpener(opener), check_every
        self._lock = threading.Lock()  # I/O threads may find a path failing together
        ask(roots, opener.answer_timeout)  # every path at once: hung ones cost one wait
        for path in self.states:  # (the mount table only: a hung mount's point is known too)
            path.mount_point = mount_point_of(path.root)
        self._open_at_start()
        self._keeper = LeaseKeeper(self._leases, beat_every, self._lease_taken)

    def _open_at_start(self) -> None:
        """Each path opened, bounded (a mount may stop answering after it answered): one at
        a time until one opens under the writer id searched for, then the others at once
        under that id, so that paths hung below their top directory cost one wait together."""
        busy: set[str] = set()  # ids whose segment another process of this host holds
        pending = list(self.states)
        while pending and not self._opener.settled:
            path = pending.pop(0)
            try:
                path.dir, path.inode = self._opener.open(path.root, busy, bounded=True)
            except OSError as exc:
                self.take_down(path, f"cannot open: {exc}")
        opened = self._opener.open_many([p.root for p in pending], busy) if pending else {}
        for path in pending:
            if isinstance(outcome := opened[path.root], BaseException):
                self.take_down(path, f"cannot open: {outcome}")
            else:
                path.dir, path.inode = outcome
        for outcome in opened.values():
            if isinstance(outcome, BaseException) and not isinstance(outcome, OSError):
                for path in self.states:  # a bug: raised as one path's open raises it, once
                    if path.dir is not None:  # what the others opened is closed (their locks)
                        path.dir.close()
                raise outcome

    @property
    def writer(self) -> str:
        """This store's writer id (``PathOpener.writer``)."""
        return self._opener.writer

    @property
    def own(self) -> tuple[str | None, ...]:
        """Each path's ``PathState.own``: the segments a reader of the shared directory
        skips as this store's own. A path where it holds none is read as every writer's
        (a segment another process opened under ``writer`` since is another writer's)."""
        return tuple(path.own for path in self.states)

    def _leases(self) -> list[Lease]:
        return [directory.lease for directory in (p.dir for p in self.states)
                if directory is not None and directory.lease is not None]

    def _lease_taken(self, lease: Lease, conflict: LeaseLost) -> None:
        """Another process wrote ``lease``'s segment, its seat is gone, or its beat has hung
        (``LeaseHung``): its path goes out of service."""
        for path in self.states:
            directory = path.dir
            if directory is not None and directory.lease is lease:
                self.take_down(path, str(conflict), directory)

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, index: int) -> PathState:
        return self.states[index]

    @property
    def down(self) -> dict[int, str]:
        """Paths out of service by index, with the reason."""
        return {i: p.down_reason for i, p in enumerate(self.states) if p.dir is None}

    @staticmethod
    def is_path_error(exc: OSError) -> bool:
        """True when ``exc`` is about the path as a whole (full, read-only, gone), not
        about the bytes one request touched."""
        return exc.errno == errno.ENOSPC or exc.errno in _PATH_FATAL

    def failed(self, path: PathState, exc: OSError, directory: CacheDir) -> IOResult:
        """The result of a request that failed with ``exc`` on ``directory`` (the path's
        directory when the request started: a failure of a directory already replaced by
        a revive says nothing about the new one)."""
        if exc.errno == errno.ENOSPC:
            return IOResult(IOStatus.NO_SPACE, detail=f"{path.root}: {exc}")
        if path.dir is not directory:
            return IOResult(IOStatus.IO_ERROR, detail=f"{path.root}: {exc} (before the path "
                            "was taken out or tried again)")
        if exc.errno in _PATH_FATAL:
            self.take_down(path, str(exc), directory)
            return IOResult(IOStatus.PATH_DOWN, detail=path.down_reason)
        path.eio_run += 1
        if path.eio_run >= _EIO_LIMIT:
            self.take_down(path, f"{_EIO_LIMIT} I/O errors in a row, last: {exc}", directory)
            return IOResult(IOStatus.PATH_DOWN, detail=path.down_reason)
        return IOResult(IOStatus.IO_ERROR, detail=f"{path.root}: {exc}")

    def note_timeout(self, index: int) -> bool:
        """A request on path ``index`` got no answer in time: it counts as an I/O error
        towards taking the path out. True when the path went down."""
        path = self.states[index]
        directory = path.dir
        if directory is None:
            return False
        path.eio_run += 1
        if path.eio_run < _EIO_LIMIT:
            return False
        self.take_down(path, f"{_EIO_LIMIT} requests in a row failed or got no answer in time",
                       directory)
        return path.dir is None

    def healthy(self, path: PathState, directory: CacheDir) -> bool:
        """Its directory (checked every ``check_every`` seconds) still the one opened."""
        now = time.monotonic()
        if now - path.checked_at >= self._check_every:
            path.checked_at = now
            try:
                inode = os.stat(directory.path, follow_symlinks=False).st_ino
            except OSError as exc:
                inode = -1
                reason = f"directory gone: {exc}"
            else:
                reason = "directory replaced"
            if inode != path.inode:
                self.take_down(path, reason, directory)
                return False
        return True

    def take_down(self, path: PathState, reason: str, directory: CacheDir | None = None) -> None:
        """Out of service, unless ``directory`` (what the failing request used) is no longer
        the path's. Its files stay open (a request may still be using them) until the path
        is tried again, ``retry_every`` seconds on, or the tier closes."""
        with self._lock:
            if (path.dir is None and path.down_reason) or (
                    directory is not None and path.dir is not directory):
                return
            path.down_reason = f"{path.root}: {reason}"
            if path.dir is not None:
                path.stale, path.dir = path.dir, None
            if path.retry_every is not None:
                now = time.monotonic()
                if (path.back_at and path.retry_first is not None
                        and now - path.back_at >= path.retry_every):
                    path.retry_every = path.retry_first  # it held longer than its last wait
                path.retry_at = now + path.retry_every
        log.error("kvtier disk path out of service: %s (%s)", path.down_reason,
                  "not tried again: disk_retry is off" if path.retry_every is None
                  else f"tried again in {path.retry_every:g} s")

    @property
    def answer_timeout(self) -> float | None:
        """How long a path's file system is given to answer (``load_timeout``; None: off)."""
        return self._opener.args.answer_timeout

    def revive_due(self) -> list[int]:
        """Indexes of paths out of service whose next try is due (no I/O: cheap to call)."""
        now = time.monotonic()
        return [i for i, p in enumerate(self.states)
                if p.dir is None and p.retry_every is not None and now >= p.retry_at]

    def revive(self, index: int) -> bool:
        """Try to reopen path ``index`` as at start, with every check (ownership,
        permissions, lock, O_DIRECT; blocking); True when it is back in service. A path that
        comes back and then stays in service for at least its current wait starts again
        from ``retry`` when it next fails."""
        path = self.states[index]
        with self._lock:
            if path.dir is not None or path.retry_every is None:
                return False
            path.retry_every = max(path.retry_every, min(2 * path.retry_every, _RETRY_MAX_S))
            path.retry_at = time.monotonic() + path.retry_every
        if not answers(path.root, self.answer_timeout):  # a hung mount: its old
            log.debug("kvtier disk path %s still does not answer", path.root)  # files are
            return False  # not closed either (a close may wait on its server)
        if (now_on := fell_through(path.root, path.mount_point)) is not None:
            reason = (f"the file system mounted at {path.mount_point} is gone (the path is on "
                      f"the one at {now_on} now): not reopened until it is mounted again")
            with self._lock:
                said, path.down_reason = path.down_reason == reason, reason
            if not said:  # said once: the cache is not for that disk
                log.warning("kvtier disk path %s: %s", path.root, reason)
            return False
        with self._lock:
            stale, path.stale = path.stale, None
        if stale is not None:
            stale.close()
        try:
            directory, inode = self._opener.open(path.root, set(), bounded=True)
        except OSError as exc:
            log.debug("kvtier disk path %s still out of service: %s", path.root, exc)
            return False
        path.mount_point = mount_point_of(path.root) or path.mount_point
        with self._lock:
            was, path.down_reason = path.down_reason, ""
            path.eio_run, path.inode, path.checked_at = 0, inode, time.monotonic()
            path.dir, path.back_at = directory, path.checked_at
        log.warning("kvtier disk path back in service: %s (was out: %s)", path.root, was)
        return True

    def close(self) -> None:
        """Stop the heartbeats and close every directory, in service or stale."""
        self._keeper.close()
        for path in self.states:
            for directory in (path.dir, path.stale):
                if directory is not None:
                    directory.close()
