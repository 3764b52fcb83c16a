"""The nodes of a Redis cluster out of service: one node that fails costs its own keys only.

A node that fails a round trip (its connection refused, reset, or no reply before the
deadline) is out of service for ``retry_s``: its keys are answered at once as failures
(misses) without asking it, while the other nodes go on serving theirs, and the round trip
after ``retry_s`` asks it again (``on_trial``). Only a round trip that no node answered,
once every primary of the slot map failed or is out, takes the whole tier out of service
(``redis_cluster``, ``RemoteTier._failed``). Going out is logged once per outage (a
warning), coming back once (info), the failed retries between at debug.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("kvtier")


class NodeOut(ConnectionError):
    """The answer for a key whose node is out of service: not asked (a miss)."""


class NodeOutages:
    """Which nodes of one cluster are out of service now, by name (``host:port``)."""

    def __init__(self, retry_s: float, store: str) -> None:
        self.retry_s, self._store = retry_s, store
        self._lock = threading.Lock()
        # a node that failed: until its next try, and whether its outage was logged (kept
        # until it answers)
        self._until: dict[str, tuple[float, bool]] = {}
        self.failures = 0  # round trips of one node that failed

    def out(self, node: str) -> NodeOut | None:
        """The answer for a key on ``node`` while it is out of service, else None."""
        with self._lock:
            until = self._until.get(node, (0.0, False))[0]
        if time.monotonic() >= until:
            return None
        return NodeOut(f"cluster node {node} out of service (tried again every {self.retry_s:g} s)")

    def on_trial(self, node: str) -> bool:
        """Whether ``node`` failed and has not answered since, its outage over: the next
        round trip asks it again (last)."""
        with self._lock:
            until = self._until.get(node)
        return until is not None and time.monotonic() >= until[0]

    def failed(self, node: str, exc: BaseException, quiet: bool = False) -> None:
        """Note that ``node`` failed a round trip (``exc``): out of service for ``retry_s``;
        ``quiet``: logged at debug only, and its coming back too (the whole tier's going out
        of service is logged instead)."""
        with self._lock:
            self.failures += 1
            warned = self._until.get(node, (0.0, False))[1]  # for this outage already
            self._until[node] = (time.monotonic() + self.retry_s, warned or not quiet)
        if not (warned or quiet):
            log.warning("kvtier: remote tier %s: cluster node %s failed (%s); its keys are misses, "
                        "it is tried again every %g s", self._store, node, exc, self.retry_s)
        else:
            log.debug("kvtier: remote tier %s: cluster node %s failed (%s)", self._store,
                      node, exc)

    def answered(self, node: str) -> None:
        """Note that ``node`` answered a round trip: an outage of it is over."""
        if node not in self._until:  # (no lock: the common case, a node never out)
            return
        with self._lock:
            logged = self._until.pop(node, (0.0, False))[1]
        if logged:
            log.info("kvtier: remote tier %s: cluster node %s is back in service", self._store, node)

    def names(self) -> list[str]:
        """The nodes out of service now."""
        now = time.monotonic()
        with self._lock:
            return [node for node, (until, _) in self._until.items() if now < until]
