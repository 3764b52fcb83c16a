"""A Redis cluster's slot map asked for anew off the round trips, one refresh at a time.

A cluster client asks its nodes for the slot map one after another (in an order of its
own), each within the socket timeout: a hung node asked first would hold the refresh for a
whole timeout, and a round trip that refreshed in line would spend its deadline on it and
fail for every node. Here a refresh runs on a thread of its own, bounded by
``REFRESH_TIMEOUTS`` socket timeouts in all; round trips go on with the map they hold
meanwhile (a key whose slot moved is followed to its new node by its redirect). A refresh
that fails leaves the map as it was, and the next round trip that finds the map stale
starts another.

redis-py asks for the map in place (``NodesManager.initialize``); before its 7.4 release
that drops every connection of the nodes it asks, those of round trips under way too. With
such a release the client is made anew instead (``remake``: from every node it knew) and
takes the old one's place; the old one is closed once every round trip that took it is
over (``RETIRED_TIMEOUTS`` socket timeouts later: each ends within one).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.io.guarded import start_thread
from kvtier.remote.deadline import bounded

log = logging.getLogger("kvtier")
REFRESH_TIMEOUTS = 3  # a refresh's bound, in socket timeouts: room for two hung nodes first
RETIRED_TIMEOUTS = 2  # a client replaced is closed this many socket timeouts later


class SlotMapRefresh:
    """Refreshes of one tier's cluster client. ``stale`` says the map is out of date (a
    redirect, a node that failed); ``start(client)`` starts a refresh where none runs."""

    def __init__(self, timeout_s: float, remake: Callable[[Any], bool]) -> None:
        self._timeout_s, self._remake = timeout_s, remake
        self._retired: list[tuple[Any, float]] = []  # clients replaced, and when
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
        if self._retired:
            self._retire(None)  # those replaced long enough ago closed
        with self._lock:
            if self._closed or not self.stale or (self._thread is not None
                                                   and self._thread.is_alive()):
                return
            self.stale = False
            thread = threading.Thread(target=self._refresh, args=(client,),
                                      name="kvtier-slot-map", daemon=True)
            if start_thread(thread):
                self._thread = thread
            else:  # still stale: tried again at the next round trip
                self.stale = True

    def _refresh(self, client: Any) -> None:
        try:
            with bounded(self._timeout_s * REFRESH_TIMEOUTS):
                if in_place(client):
                    client.nodes_manager.initialize()
                elif self._remake(client):
                    self._retire(client)
        except Exception as exc:  # the map kept: asked for again by a later round trip
            log.debug("kvtier: the Redis cluster's slot map could not be asked for anew: %s", exc)
            with self._lock:
                self.stale, self.failed = True, self.failed + 1
        with self._lock:
            self.refreshes += 1

    def _retire(self, client: Any) -> None:
        """``client`` (None: none), replaced, closed later; those replaced long enough ago
        closed now."""
        with self._lock:
            if client is not None:
                self._retired.append((client, time.monotonic()))
            due = time.monotonic() - self._timeout_s * RETIRED_TIMEOUTS
            done = [old for old, at in self._retired if at <= due]
            self._retired = [(old, at) for old, at in self._retired if at > due]
        _close(done)

    def close(self, timeout_s: float) -> None:
        """Start no refresh from now on, wait up to ``timeout_s`` for one under way (its
        client closed, it ends within its own bound: a daemon thread, never waited on
        longer), and close the clients replaced (the tier closing: its round trips over)."""
        with self._lock:
            self._closed = True
        self.wait(timeout_s)
        with self._lock:
            done, self._retired = [old for old, _ in self._retired], []
        _close(done)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a refresh under way; whether none runs now."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()


def in_place(client: Any) -> bool:
    """Whether ``client``'s redis-py asks for the map in place without dropping the
    connections of round trips under way (7.4 and later: it marks them to be made anew
    once they are released)."""
    parameters = inspect.signature(client.nodes_manager.initialize).parameters
    return "disconnect_startup_nodes_pools" in parameters


def _close(clients: list[Any]) -> None:
    for client in clients:
        with contextlib.suppress(Exception):  # a broken connection: nothing more to do
            client.close()
