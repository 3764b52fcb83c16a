"""The nodes of a store out of service alone (a Redis cluster's nodes, a Mooncake store's
holders): one node that fails costs its own keys only.

A node that fails a round trip (its connection refused, reset, or no reply before the
deadline) is out of service for ``retry_s``: its keys are answered at once as failures
(misses) without asking it, while the other nodes go on serving theirs. The first round
trip after ``retry_s`` asks it again (its trial: ``admit`` claims it, ``on_trial``); the
round trips beside that one, on other threads, still answer its keys at once, so a node
that is still hung holds one caller's deadline a ``retry_s``, not every caller's. Only a
round trip that no node answered, once every primary of the slot map failed or is out,
takes the whole tier out of service (``redis_cluster``, ``RemoteTier._failed``; a Mooncake
store's holders: ``mooncake_holders``). Going
out is logged once per outage (a warning), coming back once (info), the failed retries
between at debug.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvtier")
FORGET_S = 600.0  # a node out that no round trip asked for this long after its retry is forgotten


class NodeOut(ConnectionError):
    """The answer for a key whose node is out of service: not asked (a miss)."""


class NodeOutages:
    """Which nodes of one store are out of service now, by name (``host:port``); ``noun``:
    what logs and answers call a node."""

    def __init__(self, retry_s: float, store: str,
                 clock: Callable[[], float] = time.monotonic, noun: str = "cluster node") -> None:
        self.retry_s, self._store, self._clock, self.noun = retry_s, store, clock, noun
        self._lock = threading.Lock()
        # a node that failed: until its next try, whether its outage was logged (kept
        # until it answers), whether a round trip claimed its trial, and when it last failed
        self._until: dict[str, tuple[float, bool, bool, float]] = {}
        self.failures = 0  # round trips of one node that failed

    def _answer(self, node: str) -> NodeOut:
        return NodeOut(f"{self.noun} {node} out of service (tried again every {self.retry_s:g} s)")

    def out(self, node: str) -> NodeOut | None:
        """The answer for a key on ``node`` while it is out of service (its trial claimed
        by another round trip too), else None. Claims nothing."""
        with self._lock:
            until = self._until.get(node, (0.0, False, False, 0.0))[0]
        return self._answer(node) if self._clock() < until else None

    def admit(self, node: str) -> NodeOut | None:
        """``out``, asked once by a round trip about to ask ``node``: None where it may, and
        then, for a node whose outage is over, that round trip claims its trial: out for
        every other one until it answers or fails, or ``retry_s`` has passed again (a
        trial that never reached it)."""
        now = self._clock()
        with self._lock:
            entry = self._until.get(node)
            if entry is None:
                return None
            if now < entry[0]:
                return self._answer(node)
            self._until[node] = (now + self.retry_s, entry[1], True, entry[3])
            return None

    def on_trial(self, node: str) -> bool:
        """Whether ``node`` failed and has not answered since, and a round trip claimed its
        trial (``admit``): that one asks it, last."""
        with self._lock:
            entry = self._until.get(node)
        return entry is not None and entry[2]

    def failed(self, node: str, exc: BaseException, quiet: bool = False) -> None:
        """Note that ``node`` failed a round trip (``exc``): out of service for ``retry_s``;
        ``quiet``: logged at debug only, and its coming back too (the whole tier's going out
        of service is logged instead)."""
        now = self._clock()
        with self._lock:
            self.failures += 1
            warned = self._until.get(node, (0.0, False, False, 0.0))[1]  # this outage's
            self._until[node] = (now + self.retry_s, warned or not quiet, False, now)
            for other, (until, *_) in list(self._until.items()):  # asked no more: gone
                if until + FORGET_S < now:  # (failed over, its address moved on)
                    del self._until[other]
        if not (warned or quiet):
            log.warning("kvtier: remote tier %s: %s %s failed (%s); its keys are misses, it is "
                        "tried again every %g s", self._store, self.noun, node, exc, self.retry_s)
        else:
            log.debug("kvtier: remote tier %s: %s %s failed (%s)", self._store, self.noun, node, exc)

    def answered(self, node: str, at: float | None = None) -> None:
        """Note that ``node`` answered a round trip (its reply read at ``at``, on this
        object's clock): an outage of it is over, unless it failed after that (a round
        trip beside this one, settled first)."""
        if node not in self._until:  # (no lock: the common case, a node never out)
            return
        with self._lock:
            entry = self._until.get(node)
            if entry is None or (at is not None and at < entry[3]):
                return
            logged = self._until.pop(node)[1]
        if logged:
            log.info("kvtier: remote tier %s: %s %s is back in service", self._store, self.noun, node)

    def any(self) -> bool:
        """Whether some node is out now or was within ``retry_s`` (its trial due, or under
        way): one no round trip asks for again (gone) counts no longer."""
        if not self._until:  # (no lock: the common case, no node out)
            return False
        now = self._clock()
        with self._lock:
            return any(now < until + self.retry_s for until, *_ in self._until.values())

    def names(self) -> list[str]:
        """The nodes out of service now."""
        now = self._clock()
        with self._lock:
            return [node for node, (until, *_) in self._until.items() if now < until]
