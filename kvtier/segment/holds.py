"""Descriptors that stay open while a thread uses them: a segment's files are closed only once
no I/O holds them, so that a descriptor number can never go to another file (opened later by
any thread of the process) while a read or write of the old one is still under way."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Holds:
    """Counts the holds on a set of descriptors and releases them once, when closed and free.

    Contract: ``held()`` is a context manager around every use of a descriptor number (from
    fetching it to its last system call): it raises ``OSError`` (EBADF, naming ``what``)
    once ``close`` was called, and otherwise keeps the descriptors open until the block
    ends. ``close()`` marks them closed and calls ``release`` at once when nothing holds
    them, else when the last hold ends (on that thread); ``release`` runs exactly once. A
    thread hung in a system call keeps its hold, and the descriptors stay open, as the
    kernel keeps the file open for that call anyway. Holds nest.
    """

    def __init__(self, what: str, release: Callable[[], None]) -> None:
        self._what, self._release = what, release
        self._lock = threading.Lock()
        self._count = 0
        self.closed = False
        self._released = False

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self.closed:
                raise OSError(errno.EBADF, f"{self._what} was closed")
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1
                last = self._due()
            if last:
                self._release()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            now = self._due()
        if now:
            self._release()

    def _due(self) -> bool:
        """Whether the release is due now (and taken by the caller); under the lock."""
        if self.closed and self._count == 0 and not self._released:
            self._released = True
            return True
        return False
