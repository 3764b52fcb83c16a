"""The slot files of other writers' segments that a reader keeps open between reads.

Opening a file of another segment costs a directory walk (no symlink followed, each part
checked), so a reader keeps the files it read, at most ``MAX_OPEN``. A kept file holds its
space after it is deleted (a reclaimed segment), and on a network filesystem (NFS) a file
open on this host is not deleted but renamed (``.nfs*``), which keeps its segment, and the
seat of its writer gone, from being reclaimed: kept files are closed once deleted
(``sweep``) and when the segment is no longer followed (``let_go_writer``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from kvtier.io.guarded import start_thread

MAX_OPEN = 256  # slot files of other writers kept open; the least recently opened close first
SWEEP_S = 5.0  # how often reads close the kept files that were deleted (a reclaimed segment)

FileKey = tuple[int, str, int]  # (disk path, writer, file number)


class KeptFiles:
    """Contract: ``get(key, generation, open_)`` returns a descriptor of its own (a
    duplicate: the caller closes it) of the file ``key`` kept open for ``generation`` (the
    writer's log generation: a new one opens the file again), opened with ``open_()`` when
    none is kept; the least recently opened close past ``MAX_OPEN``. ``let_go(key)`` and
    ``let_go_writer(path, writer)`` close kept files (the next ``get`` opens them again).
    ``sweep()`` closes the kept files that no longer have a name, each looked at outside the
    lock (an ``fstat`` on a network filesystem whose server stopped answering blocks): no
    ``get`` waits for a look; ``sweep_soon()`` starts one on a thread of its own when the last
    was ``SWEEP_S`` ago or more, one at a time. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[FileKey, tuple[int, int]] = {}  # -> (fd, generation)
        self._swept = time.monotonic()
        self._sweeping = threading.Lock()  # held by the one sweep on a thread of its own

    def get(self, key: FileKey, generation: int, open_: Callable[[], int]) -> int:
        self.sweep_soon()  # never on this thread: a file on a hung mount would hold it
        with self._lock:
            held = self._fds.get(key)
            if held is not None and held[1] == generation:
                return os.dup(held[0])
        fd = open_()
        with self._lock:
            old = self._fds.pop(key, None)
            self._fds[key] = (fd, generation)
            while len(self._fds) > MAX_OPEN:
                os.close(self._fds.pop(next(iter(self._fds)))[0])
            mine = os.dup(fd)
        if old is not None:
            os.close(old[0])
        return mine

    def let_go(self, key: FileKey) -> None:
        with self._lock:
            held = self._fds.pop(key, None)
        if held is not None:
            os.close(held[0])

    def let_go_writer(self, path: int, writer: str) -> None:
        with self._lock:
            fds = [self._fds.pop(key)[0] for key in list(self._fds) if key[:2] == (path, writer)]
        for fd in fds:
            os.close(fd)

    def sweep(self) -> int:
        """Close the kept files deleted since; return how many."""
        with self._lock:
            self._swept = time.monotonic()
            kept = [(key, fd) for key, (fd, _) in self._fds.items()]
        gone = [(key, fd) for key, fd in kept if _unlinked(fd)]
        closed = 0
        with self._lock:
            for key, fd in gone:
                held = self._fds.get(key)
                if held is not None and held[0] == fd:  # not replaced meanwhile
                    os.close(self._fds.pop(key)[0])
                    closed += 1
        return closed

    def sweep_soon(self) -> None:
        if time.monotonic() - self._swept > SWEEP_S and self._sweeping.acquire(blocking=False):
            self._swept = time.monotonic()
            if not start_thread(threading.Thread(target=self._sweep_then_free, name="kvtier-sweep",
                                                 daemon=True)):
                self._sweeping.release()  # tried again at a later call

    def _sweep_then_free(self) -> None:
        try:
            self.sweep()
        finally:
            self._sweeping.release()

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _unlinked(fd: int) -> bool:
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:  # a network filesystem's stale handle: deleted as well
        return True
