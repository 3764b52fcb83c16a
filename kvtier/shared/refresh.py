"""Refreshing views of other writers in the background."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvtier.units import wait_limit

log = logging.getLogger("kvtier")
SOON_GAP_S = 0.01  # refreshes asked for with ``soon`` come at most this often


class RefreshThread:
    """A daemon thread calling ``refresh()`` at once, then every ``every`` seconds until
    ``close``, and sooner when ``soon()`` asks (a request waits for another engine's
    chunks); an exception is logged once (the views it refreshes are then only stale) and
    the next refresh tried as usual. Made, it waits for the first refresh ``first_wait``
    seconds at most (None: as long as it takes): one held longer (a hung mount) goes on in
    the background, and the views are empty until it ends."""

    def __init__(self, refresh: Callable[[], None], every: float, first_wait: float | None = None) -> None:
        self._refresh, self._every = refresh, every
        self._stop = threading.Event()
        self._wake = threading.Event()  # a refresh wanted before ``every`` is over
        self._wake.set()  # the first one at once
        self._first = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="kvtier-share", daemon=True)
        self._thread.start()
        if not self._first.wait(wait_limit(first_wait)):
            log.warning("kvtier: the first look at other writers' segments has not ended in %g s "
                        "(a hung mount?): the engine starts without their chunks, found once "
                        "it ends", first_wait)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._every)
            if self._stop.is_set():
                self._first.set()
                return
            self._wake.clear()
            try:
                self._refresh()
            except Exception as exc:  # a bug or an unforeseen error: never the thread's end
                if not self._failed:
                    log.warning("kvtier: looking at other writers' segments failed: %r (tried "
                                "again every %g s; further failures are not logged)", exc,
                                self._every)
                self._failed = True
            self._first.set()
            if self._stop.wait(SOON_GAP_S):  # refreshes asked for soon: this far apart at least
                return

    def soon(self) -> None:
        """Refresh now rather than at the next period (``SOON_GAP_S`` after the last at most)."""
        self._wake.set()

    def close(self, timeout: float | None = None) -> bool:
        """Stop the thread, waiting at most ``timeout`` for a refresh under way; False when
        one still runs then (blocked on a hung mount): what it reads must stay open."""
        self._stop.set()
        self._wake.set()
        self._thread.join(wait_limit(timeout))
        return not self._thread.is_alive()
