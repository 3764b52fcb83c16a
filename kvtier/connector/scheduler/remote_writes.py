"""The scheduler side's remote writes: which host chunks go to the remote store, when, and
the host slots they hold until every rank's copy is written."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtier.connector.common.messages import RemoteWrite, WorkerReport
from kvtier.connector.scheduler.rank_counts import RankOutcomes
from kvtier.keys import ChunkKey
from kvtier.remote.known import KNOWN_MIN, HitCounts, KnownKeys
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import Location, TierStack

HOST = TierName.HOST


@dataclass(frozen=True)
class _Aborted:
    host: Location
    release: Callable[[ChunkKey], None]  # called once no rank sends from ``host`` any more


class RemoteWrites:
    """Contract: ``with_store(key)`` says whether a chunk being planned for store goes to
    the store as well (``remote_min_hits`` 0: the workers write it right after their host
    copy, like write-through), recording it pending; ``stored(key, host)`` (every rank
    stored it) pins its host slot until the write is over; ``hold_failed(key, host, release)``
    (some rank failed its host store) calls ``release(key)`` once every rank's remote outcome
    is in, since ranks whose copy succeeded still send from the slot until then.
    ``take_records()`` hands over the token records of the chunks written since (those
    planned with one, or given one by ``add_record``). ``loaded(key)`` (a chunk
    loaded from this engine's host memory or disk) counts a hit and, at the
    ``min_hits``-th (with 0: when an earlier write of it failed or was dropped), queues a
    ``RemoteWrite`` with its host slot pinned, which ``take_new()`` hands to the step's
    plan; ``again(key)`` (a chunk found cached at a store) does so at once with ``min_hits``
    0, when the store is not known to hold it. ``in_store(key)`` notes a chunk the store is known to hold
    (loaded from it: not written again while remembered), ``lost(key)`` one whose read from
    it failed (written again at its next store), and so is each key ``lost()`` returns (the
    store answered a lookup "not there": a restart or an eviction lost it), before each
    decision. A pin ends once ``apply`` saw
    every rank's outcome. Past ``max_pending`` writes in flight, new ones are dropped and
    counted (``remote_dropped_chunks``); none is planned while ``down()`` says the store is
    out of service. With ``tries`` above 1 (a producer's: ``pool_writes``) a write that
    failed (its host store did not) is written again from host memory as a lost chunk is,
    up to ``tries`` writes of it in all (``pool_rewritten_chunks``; past them, or no longer
    in host memory, ``pool_given_up_chunks``). ``busy()``: a write is out or due again."""

    def __init__(self, stack: TierStack, counters: Counter, world_size: int, min_hits: int,
                 max_pending: int, down,
                 lost: Callable[[], Iterable[ChunkKey]] | None = None, tries: int = 1) -> None:
        self._stack, self._counters, self._min_hits = stack, counters, min_hits
        self._max_pending, self._down, self._lost, self._tries = max_pending, down, lost, tries
        capacity = max(KNOWN_MIN, 2 * sum(index.num_slots for index in stack.indexes.values()))
        self._known, self._capacity = KnownKeys(capacity), capacity
        self._hits = HitCounts(capacity)
        self._outcomes = RankOutcomes(world_size)
        # key -> its host slot: pinned, None (its host store not over yet), or an aborted
        # host reservation the remote writes still read from (ended once they are over)
        self._pending: dict[bytes, Location | _Aborted | None] = {}
        self._new: list[RemoteWrite] = []
        self._records: dict[bytes, bytes] = {}  # key -> its token record, while written
        self._written: list[tuple[ChunkKey, bytes]] = []  # written with a record, not taken
        # to write again: lost by the store (0), or the writes of it that failed so far
        self._rewrite: OrderedDict[ChunkKey, int] = OrderedDict()
        self._made: dict[bytes, int] = {}  # key -> writes made of it, a write again out

    def with_store(self, key: ChunkKey, record: bytes = b"") -> bool:
        self.forget_lost()
        if self._min_hits or key in self._known or not self._room():
            return False
        self._known.add(key)
        self._pending[key] = None
        if record:
            self._records[key] = record
        return True

    def take_records(self) -> list[tuple[ChunkKey, bytes]]:
        """The token records of the chunks written to the store since the last call, for
        its log of them (``RemoteTier.append_records``)."""
        written, self._written = self._written, []
        return written

    def stored(self, key: ChunkKey, host: Location) -> None:
        if key in self._pending and self._pending[key] is None:
            self._stack.indexes[HOST].pin(key)
            self._pending[key] = host

    def hold_failed(self, key: ChunkKey, host: Location,
                    release: Callable[[ChunkKey], None]) -> bool:
        """A store some rank failed, whose remote write other ranks may still be sending
        from ``host``: True when its remote write is pending, and ``release(key)`` is called
        once every rank's remote outcome is in (the caller ends the host reservation then)."""
        if key not in self._pending or self._pending[key] is not None:
            return False
        self._pending[key] = _Aborted(host, release)
        return True

    def loaded(self, key: ChunkKey) -> bool:
        """A hit on ``key`` here: True when it queued the chunk's write to the store (its
        token record may follow, ``add_record``)."""
        self.forget_lost()
        if key in self._known or key in self._pending:
            return False
        if self._hits.hit(key) < self._min_hits:
            return False
        self._hits.forget(key)
        return self._from_host(key)

    def again(self, key: ChunkKey) -> bool:
        """A chunk found cached at a store (computed again, vLLM's own hit say): with
        ``min_hits`` 0, written to the store from host memory when the store is not known to
        hold it and no write of it is out (one dropped or failed before: a producer's hand-off
        waits for none but the pool's chunks)."""
        if self._min_hits or key in self._known or key in self._pending:
            return False
        return self._from_host(key)

    def _from_host(self, key: ChunkKey) -> bool:
        """Queue ``key``'s write when host memory holds it; True when queued."""
        location = self._stack.locate(key)
        return location is not None and location.tier is HOST and self._queue(key, location)

    def add_record(self, key: ChunkKey, record: bytes) -> None:
        """The token record of a chunk whose write is in flight, for the store's log once
        every rank wrote it (a write queued by ``loaded``, planned with none)."""
        if record and key in self._pending:
            self._records[key] = record

    def in_store(self, key: ChunkKey) -> None:
        self._known.add(key)

    def forget_lost(self) -> None:
        """Forget the chunks the store said it lost (not those being written now); with
        ``remote_min_hits`` 0, those still in host memory are written again at once, or, past
        ``max_pending`` writes in flight, as soon as there is room (while still there)."""
        if self._lost is not None:
            for key in self._lost():
                if key in self._pending or key not in self._known:
                    continue
                self._known.discard(key)
                if not self._min_hits:
                    self._again_later(key, 0)
        while self._rewrite and not self._down() and len(self._pending) < self._max_pending:
            key, failed = self._rewrite.popitem(last=False)
            if key in self._known:
                continue
            queued = self._from_host(key)
            if failed:  # a write of it failed: written again, or given up
                self._counters["pool_rewritten_chunks" if queued else "pool_given_up_chunks"] += 1
                if queued:
                    self._made[key] = failed + 1

    def _again_later(self, key: ChunkKey, failed: int) -> None:
        """``key`` to be written again from host memory once the store has room
        (``failed``: the writes of it that failed, 0 for one the store lost)."""
        self._rewrite[key] = failed
        if len(self._rewrite) > self._capacity:
            _, dropped = self._rewrite.popitem(last=False)
            if dropped:  # a failed write of it will not be made again
                self._counters["pool_given_up_chunks"] += 1

    def oldest_known(self, count: int) -> list[ChunkKey]:
        """Up to ``count`` keys known to be in the store, those checked least recently
        first (they count as checked now), but for those being written now."""
        return [key for key in self._known.oldest(count) if key not in self._pending]

    def holds(self, key: ChunkKey) -> bool:
        """Whether the store is known to hold ``key`` or a write of it is in flight."""
        return key in self._known or key in self._pending

    def busy(self) -> bool:
        """Whether a write to the store is in flight, or one is due again."""
        return bool(self._pending or self._rewrite)

    def writing(self, key: ChunkKey) -> bool:
        """Whether a write of ``key`` to the store is in flight."""
        return key in self._pending

    def lost(self, key: ChunkKey) -> None:
        """A read of ``key`` found the store without it (evicted, or a damaged value): not
        known to be there any more, so its next store writes it again (over the damage). A
        read that failed otherwise (a timeout, a redirect) is no such news."""
        self._known.discard(key)

    def _room(self) -> bool:
        """Whether a write may be planned now: the store in service, and room in flight."""
        if self._down():
            return False
        if len(self._pending) >= self._max_pending:
            self._counters["remote_dropped_chunks"] += 1
            return False
        return True

    def _queue(self, key: ChunkKey, host: Location) -> bool:
        if key in self._pending or not self._room():
            return False
        self._known.add(key)
        self._stack.indexes[HOST].pin(key)
        self._pending[key] = host
        self._new.append(RemoteWrite(key, host.slot, record=True))  # its record, if kept there
        return True

    def take_new(self) -> list[RemoteWrite]:
        new, self._new = self._new, []
        return new

    def apply(self, report: WorkerReport) -> None:
        for key in set(report.remote_written) | set(report.remote_failed):
            if key not in self._pending:
                continue
            ok = self._outcomes.add(key, report.remote_written[key], report.remote_failed[key])
            if ok is None:
                continue
            host, made = self._pending.pop(key), self._made.pop(key, 1)
            if isinstance(host, _Aborted):  # its host store failed: no rank sends it any more
                host.release(ChunkKey(key))
                ok = False
            elif host is not None:  # else its host store is not over: nothing pinned
                self._stack.unpin(ChunkKey(key), host)
            self._counters["remote_written_chunks" if ok else "remote_failed_chunks"] += 1
            record = self._records.pop(key, b"") or report.remote_records.get(key, b"")
            if ok and record:
                self._written.append((ChunkKey(key), record))
            if not ok:
                self._known.discard(ChunkKey(key))
                self._failed(ChunkKey(key), made, isinstance(host, _Aborted))

    def _failed(self, key: ChunkKey, made: int, aborted: bool) -> None:
        """A write of ``key`` failed (``made``: the writes of it so far): written again
        from host memory while tries are left (not when its host store failed)."""
        if self._tries <= 1 or aborted:
            return
        if made >= self._tries:
            self._counters["pool_given_up_chunks"] += 1
        else:
            self._again_later(key, made)
