"""Refreshing views of other writers in the background."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("kvtier")


class RefreshThread:
    """A daemon thread calling ``refresh()`` every ``every`` seconds until ``close``; an
    exception is logged once (the views it refreshes are then only stale) and the next
    refresh tried as usual."""

    def __init__(self, refresh: Callable[[], None], every: float) -> None:
        self._refresh, self._every = refresh, every
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="kvtier-share", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._refresh()
            except Exception as exc:  # a bug or an unforeseen error: never the thread's end
                if not self._failed:
                    log.warning("kvtier: looking at other writers' segments failed: %r (tried "
                                "again every %g s; further failures are not logged)", exc,
                                self._every)
                self._failed = True

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
