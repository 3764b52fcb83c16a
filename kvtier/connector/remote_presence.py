"""Which chunks of a request the remote store holds, as the scheduler side asks it: one
round trip per request and rank (every rank's copy must be there), on a thread of its own,
never on the engine's step."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from kvtier.config import KVTierConfig
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.base import RemoteTier
from kvtier.remote.urls import open_remote

log = logging.getLogger("kvtier")
# how long the first call about a request waits for the store's answer on the step itself: a
# round trip on a LAN is well inside it, and a request asked to come back waits a whole step
INLINE_WAIT_S = 0.002


class RemotePresence:
    """Contract: ``held(req_id, keys)`` returns, for each of ``keys`` (a request's chunk
    keys), whether every rank's copy is in the store, once known; None while the question
    runs (the caller asks again next step). The first call about a request asks, in the
    background, and waits for the answer at most ``INLINE_WAIT_S``; the answer is kept until
    ``forget(req_id)``, and asked again when the keys grow or change (a
    request's tail key gives way to its full chunk's). While the store is out of
    service the answer is "none" at once. A question not answered within ``wait_s`` counts
    as "none". ``close()`` stops the thread and the tiers."""

    def __init__(self, tiers: Sequence[RemoteTier], wait_s: float) -> None:
        self.tiers, self._wait_s = list(tiers), wait_s
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvtier-remote-lookup")
        # req id -> (the keys asked, when, the answer)
        self._asked: dict[str, tuple[tuple[ChunkKey, ...], float, Future[list[bool]]]] = {}
        self._closed = False
        self.lookups = 0  # questions asked

    @property
    def down(self) -> bool:
        return any(tier.down for tier in self.tiers)

    def held(self, req_id: str, keys: Sequence[ChunkKey]) -> list[bool] | None:
        asked = self._asked.get(req_id)
        if asked is None or tuple(asked[0][:len(keys)]) != tuple(keys):  # more keys, or others
            if self.down or self._closed:
                return [False] * len(keys)
            self.lookups += 1
            asked = (tuple(keys), time.monotonic(), self._pool.submit(self._ask, list(keys)))
            self._asked[req_id] = asked
            wait_futures([asked[2]], timeout=INLINE_WAIT_S)
        asked_keys, since, answer = asked
        count = len(asked_keys)
        if not answer.done():
            if time.monotonic() - since < self._wait_s:
                return None
            return [False] * len(keys)
        try:
            found = answer.result()
        except Exception as exc:  # a bug, not a store fault (those are results): a miss
            log.warning("kvtier: remote lookup failed: %r", exc)
            found = [False] * count
        return (found + [False] * len(keys))[:len(keys)]

    def _ask(self, keys: list[ChunkKey]) -> list[bool]:
        found = [True] * len(keys)
        for tier in self.tiers:  # every rank's copy
            found = [a and b for a, b in zip(found, tier.exists(keys), strict=True)]
        return found

    def forget(self, req_id: str) -> None:
        self._asked.pop(req_id, None)

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        for tier in self.tiers:
            tier.close()


def open_presence(config: KVTierConfig, namespaces: Sequence[Namespace],
                  raw_bytes: int) -> RemotePresence | None:
    """The scheduler side's questions to the remote store (None without ``remote_url``)."""
    tiers = [open_remote(config, ns, raw_bytes) for ns in namespaces]
    if not tiers or tiers[0] is None:
        return None
    return RemotePresence([t for t in tiers if t is not None], 2 * config.remote_timeout)
