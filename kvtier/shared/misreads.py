"""Reads of other writers' copies that failed: which failures prove a copy bad (it is then
forgotten), and how many failures that prove nothing a copy is given before it is given up.

A network filesystem fails reads for a moment (``EIO``, ``EAGAIN``, ``ETIMEDOUT``, a stale
handle, a signal, a read that comes back short): forgetting a copy for that would make it a
miss for every later request until its writer writes that slot again. Forgetting it only
once its header or checksum failed, or its file is gone, keeps a reader serving what the
writers hold; counting the other failures bounds what a path that stays broken costs.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Hashable

from kvtier.io.result import IOResult, IOStatus
from kvtier.io.safefs import UnsafeEntry

MISSES_IN_A_ROW = 3  # failed reads of one copy, none proving it bad, that give it up
MAX_COUNTED = 4096  # copies whose run of failed reads is counted; the oldest forgotten first


def proves_bad(result: IOResult) -> bool:
    """Whether a failed read of another writer's copy proves the copy bad: its header or
    payload did not check out (``CORRUPT``: overwritten since, damaged, another chunk), or
    its file is gone or is not a file kvtier wrote (``MISSING``). Any other failure (an I/O
    error, a short read, a read not over in time) says nothing of the copy."""
    return result.status in (IOStatus.CORRUPT, IOStatus.MISSING)


def failed_read(exc: OSError, writer: str) -> IOResult:
    """The result of a read of ``writer``'s copy that raised ``exc``: ``MISSING`` when the
    file (or its segment) is gone (``ENOENT``) or is refused as not kvtier's (``UnsafeEntry``:
    a symlink, another user's, a special file); ``IO_ERROR`` otherwise, the next read may
    work (``EIO``, ``EAGAIN``, ``ETIMEDOUT``, ``ESTALE``, ``EINTR``, ``EMFILE``...)."""
    gone = exc.errno == errno.ENOENT or isinstance(exc, UnsafeEntry)
    return IOResult(IOStatus.MISSING if gone else IOStatus.IO_ERROR, detail=f"writer {writer}: {exc}")


def short_read(writer: str, got: int, wanted: int) -> IOResult:
    """A read of ``writer``'s copy that found the file ending after ``got`` of ``wanted``
    bytes: nothing proven (a network filesystem's stale size; a writer that cut its files
    starts a new log, and readers forget its copies then)."""
    return IOResult(IOStatus.IO_ERROR, max(got, 0),
                    f"writer {writer}: short read ({max(got, 0)} of {wanted} bytes)")


class Misreads:
    """Failed reads of copies, counted per copy (any hashable naming one), in a row.

    Contract: ``missed(copy)`` counts a failed read that proved nothing and returns True
    once ``limit`` of them came in a row (the copy is to be given up; its count starts
    over); ``forget(copy)`` ends its run (a read that checked out, or the copy dropped). At
    most ``most`` copies are counted: past that, the oldest count is forgotten (that copy is
    read again, each read checked). Thread-safe."""

    def __init__(self, limit: int = MISSES_IN_A_ROW, most: int = MAX_COUNTED) -> None:
        self._limit, self._most = limit, most
        self._lock = threading.Lock()
        self._runs: dict[Hashable, int] = {}  # in the order first counted

    def missed(self, copy: Hashable) -> bool:
        with self._lock:
            run = self._runs.pop(copy, 0) + 1
            if run >= self._limit:
                return True
            self._runs[copy] = run
            while len(self._runs) > self._most:
                del self._runs[next(iter(self._runs))]
            return False

    def forget(self, copy: Hashable) -> None:
        if self._runs:  # no lock taken for the usual case: nothing counted
            with self._lock:
                self._runs.pop(copy, None)

    def __len__(self) -> int:
        return len(self._runs)
