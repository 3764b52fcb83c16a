"""A Redis cluster's slot map asked for anew off the round trips, one refresh at a time.

A cluster client asks its nodes for the slot map one after another (in an order of its
own), each within the socket timeout: a hung node asked first would hold the refresh for a
whole timeout, and a round trip that refreshed in line would spend its deadline on it and
fail for every node. Here a refresh runs on a thread of its own, bounded by
``REFRESH_TIMEOUTS`` socket timeouts in all; round trips go on with the map they hold
meanwhile (a key whose slot moved is followed to its new node by its redirect). A refresh
that fails leaves the map as it was, and the next round trip that finds the map stale
starts another.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvtier.remote.deadline import bounded

log = logging.getLogger("kvtier")
REFRESH_TIMEOUTS = 3  # a refresh's bound, in socket timeouts: room for two hung nodes first


class SlotMapRefresh:
    """Refreshes of one tier's cluster client. ``stale`` says the map is out of date (a
    redirect, a node that failed); ``start(client)`` starts a refresh where none runs."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.stale = False
        self.refreshes = 0  # refreshes over, well or not
        self.failed = 0  # of them, those that failed
        self._closed = False

    def mark(self) -> None:
        """A reply said the map is out of date: the next round trip starts a refresh."""
        with self._lock:
            self.stale = True

    def start(self, client: Any) -> None:
        """Ask ``client`` for its slot map anew on a thread of its own, where the map is
        stale and no refresh runs (the flag cleared: one that fails sets it again)."""
        with self._lock:
            if self._closed or not self.stale or (self._thread is not None
                                                   and self._thread.is_alive()):
                return
            self.stale = False
            self._thread = threading.Thread(target=self._refresh, args=(client,),
                                            name="kvtier-slot-map", daemon=True)
            self._thread.start()

    def _refresh(self, client: Any) -> None:
        try:
            with bounded(self._timeout_s * REFRESH_TIMEOUTS):
                client.nodes_manager.initialize()
        except Exception as exc:  # the map kept: asked for again by a later round trip
            log.debug("kvtier: the Redis cluster's slot map could not be asked for anew: %s", exc)
            with self._lock:
                self.stale, self.failed = True, self.failed + 1
        with self._lock:
            self.refreshes += 1

    def close(self, timeout_s: float) -> None:
        """Start no refresh from now on, and wait up to ``timeout_s`` for one under way (its
        client closed, it ends within its own bound: a daemon thread, never waited on
        longer)."""
        with self._lock:
            self._closed = True
        self.wait(timeout_s)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a refresh under way; whether none runs now."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()
