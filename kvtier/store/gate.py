"""The calls in flight on a ``KVStore``, so that ``close`` tears nothing down under them."""

from __future__ import annotations

import threading
from types import TracebackType

from kvtier.errors import KVTierError, StoreClosedError
from kvtier.units import wait_limit

CLOSED = "kvtier store is closed; open a new KVStore"


class CallGate:
    """Counts the public calls in flight, and closes.

    Contract: each public call runs inside ``with gate:``, which raises
    ``StoreClosedError`` once ``close`` has begun. ``close(timeout)`` lets no call in from
    then on and waits up to ``timeout`` seconds (None: no bound) for those inside to
    leave: True when none is left. A call that was inside when the store closed and fails
    (its engine or memory gone under it: a hung drive kept it past ``close``'s timeout)
    raises ``StoreClosedError``, with the error it hit as its cause; kvtier's own errors
    (a bad tensor, bad tokens) go through as they are. Cost per call: two short locks
    (0.7 us together on this project's 2-core VM).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._inside = 0
        self._closed = False
        self._closer = threading.Lock()  # held by the ``close()`` at work

    @property
    def closed(self) -> bool:
        return self._closed

    def check(self) -> None:
        """``StoreClosedError`` once ``close`` has begun (for calls that touch nothing
        ``close`` releases)."""
        if self._closed:
            raise StoreClosedError(CLOSED)

    def __enter__(self) -> None:
        with self._lock:  # the condition's lock, taken directly: this is on every call
            if self._closed:
                raise StoreClosedError(CLOSED)
            self._inside += 1

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._lock:
            self._inside -= 1
            closed = self._closed
            if closed and not self._inside:
                self._changed.notify_all()
        if closed and isinstance(exc, Exception) and not isinstance(exc, KVTierError):
            raise StoreClosedError(f"{CLOSED} (it closed during this call: {exc!r})") from exc

    def close(self, timeout: float | None) -> bool:
        with self._changed:
            self._closed = True
            return self._changed.wait_for(lambda: not self._inside, wait_limit(timeout))

    def closing(self, timeout: float | None) -> bool:
        """Become the one ``KVStore.close`` at work (``closed_by_me`` ends it), waiting up to
        ``timeout`` seconds for another one to end: False when it has not. Two closes at
        once would close the same files twice, the second time another thread's."""
        if timeout is None:
            return self._closer.acquire()
        return self._closer.acquire(timeout=min(max(timeout, 0.0), threading.TIMEOUT_MAX))

    def closed_by_me(self) -> None:
        self._closer.release()

    @property
    def inside(self) -> int:
        """Calls in flight now."""
        with self._changed:
            return self._inside
