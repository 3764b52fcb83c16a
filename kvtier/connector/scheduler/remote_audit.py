"""The scheduler side's periodic check of what the remote store still holds: a store that
restarted empty, or evicted chunks this engine wrote, loses them without a word, and a chunk
this engine keeps hitting in its own tiers is never asked for there. So every ``every_s``
the chunks known to be in the store, ``batch`` at a time (oldest checked first), are asked
about in the background; those the store answers "not there" are forgotten, and written
again: at once from host memory (``remote_min_hits`` 0), else at their next store."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future

from kvtier.config.settings import KVTierConfig
from kvtier.connector.scheduler.remote_presence import RemotePresence
from kvtier.connector.scheduler.remote_writes import RemoteWrites
from kvtier.remote.lane import writes_in_flight
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import TierStack

AUDIT_EVERY_S = 10.0  # a check this often: all of the store's chunks every few minutes
AUDIT_KEYS = 1024  # keys a check asks about: one round trip


class RemoteAudit:
    """Contract: ``tick()``, once per scheduler step, costs nothing but a clock read unless
    a check is due: then it hands the next ``batch`` known keys to ``presence.audit`` (a
    background round trip; one out at a time, none while the store is out of service) and
    returns. The answer's "not there" keys reach ``writes`` through ``presence``'s absent
    keys, which ``writes.forget_lost()`` takes at the next tick. A check that found losses
    (a restart, most likely) is followed by the next one at the next tick, until a check
    finds none. Each tick also hands the token records of the chunks written since to
    the store's log of them (``presence.log``). ``counters``: ``remote_audited_chunks`` (keys asked about) and
    ``remote_lost_chunks`` (answered "not there")."""

    def __init__(self, presence: RemotePresence, writes: RemoteWrites, counters: Counter,
                 every_s: float = AUDIT_EVERY_S, batch: int = AUDIT_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._presence, self._writes, self._counters = presence, writes, counters
        self._every_s, self._batch, self._clock = every_s, batch, clock
        self._due = clock() + every_s
        self._out: Future[list[bool] | None] | None = None

    def tick(self) -> None:
        self._writes.forget_lost()
        records = self._writes.take_records()
        if records:
            self._presence.log(records)
        out = self._out
        if out is not None:
            if not out.done():
                return
            self._out = None
            self._over(out)
        if self._clock() < self._due or self._presence.down:
            return
        self._due = self._clock() + self._every_s
        keys = self._writes.oldest_known(self._batch)
        if keys:
            self._out = self._presence.audit(keys)
            self._counters["remote_audited_chunks"] += len(keys)

    def _over(self, answer: Future[list[bool] | None]) -> None:
        found = None if answer.cancelled() or answer.exception() is not None else answer.result()
        if found is None:  # a round trip failed: nothing learnt
            return
        lost = found.count(False)
        self._counters["remote_lost_chunks"] += lost
        if lost:  # a restart, most likely: the next check at once
            self._due = self._clock()


def remote_writes(presence: RemotePresence | None, stack: TierStack, counters: Counter,
                  world_size: int, config: KVTierConfig, chunk_bytes: int, tries: int = 1,
                  ) -> tuple[RemoteWrites | None, RemoteAudit | None]:
    """The scheduler side's remote writes and their periodic check (None without a remote
    store): at most ``writes_in_flight`` in flight (``chunk_bytes``: a rank's chunk), each
    chunk's at most ``tries`` times when they fail (``RemoteWrites``)."""
    if presence is None:
        return None, None
    writes = RemoteWrites(stack, counters, world_size, config.remote_min_hits,
                          writes_in_flight(stack.indexes[TierName.HOST].num_slots, chunk_bytes),
                          lambda: presence.down, presence.take_absent, tries)
    return writes, RemoteAudit(presence, writes, counters)
