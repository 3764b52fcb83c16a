"""The remote tier as one ``KVStore`` uses it: which chunks the store holds (asked once per
call), chunks read into host slots on the tier's threads, and chunks that reached host
memory written to it in the background (every one, or those loaded ``remote_min_hits``
times), each keeping its host slot pinned until the store answered."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

from kvtier.config.remote_url import backend_of
from kvtier.config.settings import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.logs import FailureLog
from kvtier.remote.base import RemoteTier
from kvtier.remote.known import KNOWN_MIN, HitCounts, KnownKeys
from kvtier.remote.lane import RemoteLane, RemotePut
from kvtier.remote.opening import open_remote
from kvtier.store.stats import StoreStats
from kvtier.tiers.base import TierName
from kvtier.tiers.host import HostTier
from kvtier.tiers.stack import Location, TierStack
from kvtier.units import time_left

HOST = TierName.HOST
QUEUED_BYTES = 256 * 2**20  # chunks queued for the store at most (and half the host slots)


class StoreRemote:
    """The remote tier of one ``KVStore``.

    Contract (methods marked "lock held" run under the store's lock, the rest without it):

    - ``present(keys)``: how many of ``keys``, from the first, the store holds: one round
      trip, blocking (0 while the tier is out of service).
    - ``reached_host(key, slot)`` (lock held): a chunk became visible in host slot ``slot``;
      with ``remote_min_hits`` 0 its write is queued. ``loaded(key, slot)`` (lock held): a
      get served a chunk held in host slot ``slot``; at its ``remote_min_hits``-th load (with
      0: at any load, when a write of it was dropped or failed) its write is queued.
      ``start()`` (lock not held) submits the writes queued.
    - ``get(pairs)`` (on ``lane``'s threads): chunks read into host slots, verified;
      ``read_over(key, result)`` (lock held) counts what came of one.
    - A queued write pins its host slot until the store answered; chunks the store holds
      (written, or read from it) are not written again while remembered (``KnownKeys``).
      Writes are dropped, and counted, past ``max_pending`` queued (each holds a host slot).
    - ``flush(deadline)`` writes what ``reached_host`` could not queue, and waits;
      ``drain(timeout)`` waits for reads and writes; ``close(timeout)`` as ``RemoteLane``.
    """

    def __init__(self, tier: RemoteTier, config: KVTierConfig, host: HostTier, stack: TierStack,
                 stats: StoreStats, failures: FailureLog, lock, max_pending: int) -> None:
        self.tier, self.backend = tier, backend_of(config.remote_url or "")
        self._host, self._stack, self._stats, self._failures = host, stack, stats, failures
        self._lock, self._max_pending = lock, max_pending
        self._min_hits = config.remote_min_hits
        slots = sum(index.num_slots for index in stack.indexes.values())
        self._known = KnownKeys(max(KNOWN_MIN, 2 * slots))
        self._hits = HitCounts(max(KNOWN_MIN, 2 * slots))
        self._groups: list = []  # put jobs opened under the lock, started once it is released
        tier.register(host.buffer.array)
        self.lane = RemoteLane(tier, config.io_threads, host.slot_array, self._settle)

    def present(self, keys: Sequence[ChunkKey]) -> int:
        if not keys or self.tier.down:
            return 0
        failed_before = self.tier.failures
        held = self.tier.exists(keys)
        with self._lock:
            self._stats.remote_lookups += 1
            if self.tier.failures != failed_before:  # the round trip failed: "none held"
                self._stats.remote_failures += 1
        count = 0
        for found in held:
            if not found:
                break
            count += 1
        return count

    def held(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """``present(keys)`` as a flag per key of the leading run (a prefix walk's answer)."""
        return [True] * self.present(keys)

    def reached_host(self, key: ChunkKey, slot: int) -> None:
        if not self._min_hits and key not in self._known:
            self._queue(key, slot)

    def loaded(self, key: ChunkKey, slot: int) -> None:
        if key in self._known:
            return
        if self._hits.hit(key) < self._min_hits:  # with 0: a write dropped or failed goes again
            return
        self._hits.forget(key)
        self._queue(key, slot)

    def _queue(self, key: ChunkKey, slot: int) -> bool:
        """Queue the write of a host chunk, its slot pinned (lock held; ``start`` submits
        it). Not while the tier is out of service; dropped past ``max_pending``. True when
        queued, or when there is nothing to write (the chunk left that slot meanwhile)."""
        if self.lane.closed or self.tier.down:
            return False
        if self.lane.puts_pending >= self._max_pending:
            self._stats.remote_dropped_writes += 1
            self._failures.note("remote write dropped", "the remote write queue is full; the "
                                "chunk is written by flush() or at a later load (counted in "
                                "remote_dropped_writes)")
            return False
        index = self._stack.indexes[HOST]
        pinned = index.pin(key)
        if pinned != slot:  # gone or moved since it was seen there: nothing to write
            if pinned is not None:
                index.unpin(key)
            return True
        self._known.add(key)  # queued: not queued again meanwhile
        _, group = self.lane.put(RemotePut(key, slot))
        if group is not None:
            self._groups.append(group)
        return True

    def start(self) -> None:
        """Submit the put jobs queued since the last call (lock not held)."""
        with self._lock:
            groups, self._groups = self._groups, []
        for group in groups:
            with contextlib.suppress(RuntimeError):  # closed: settled as never run
                self.lane.start(group)

    def _settle(self, items: Sequence[RemotePut], results: Sequence[IOResult] | None) -> None:
        with self._lock:
            for i, item in enumerate(items):
                self._stack.unpin(item.key, Location(HOST, item.slot))
                result = results[i] if results is not None else None
                if result is not None and result.ok:
                    self._stats.remote_writes += 1
                    self._stats.remote_write_bytes += result.nbytes
                    continue
                self._known.discard(item.key)
                if result is not None:
                    self._failed("write", result)

    def get(self, pairs: Sequence[tuple[ChunkKey, int]]) -> list[IOResult]:
        """Read chunks into host slots, verified: (key, host slot) each; on a remote thread."""
        return self.tier.get_many([key for key, _ in pairs],
                                  [self._host.slot_array(slot) for _, slot in pairs])

    def read_over(self, key: ChunkKey, result: IOResult) -> None:
        if result.ok:
            self._known.add(key)
            self._stats.remote_reads += 1
            self._stats.remote_read_bytes += result.nbytes
            return
        self._known.discard(key)
        if result.status is IOStatus.MISSING:
            self._stats.remote_misses += 1
        else:
            self._failed("read", result)

    def _failed(self, op: str, result: IOResult) -> None:
        self._stats.remote_failures += 1
        self._failures.note(f"remote {op} {result.status.value}", result.detail)

    def drain(self, timeout: float | None) -> bool:
        return self.lane.drain(timeout)

    def flush(self, deadline: float | None) -> bool:
        """With ``remote_min_hits`` 0, write the host chunks the store is not known to hold
        (writes dropped under back-pressure, or failed), as many at a time as the queue has
        room for, each tried once (a write other traffic crowded out of the queue is not a
        try); then wait for every write, until ``deadline``. True when all are over; False
        past the deadline, or with chunks left unwritten because the tier is out of service."""
        tried: set[ChunkKey] = set()
        while self.drain(time_left(deadline)):  # the queue empty: fill it now
            if self._min_hits:
                return True
            with self._lock:
                host = self._stack.indexes[HOST]
                visible = host.keys()
                todo = [key for key in visible if key not in self._known and key not in tried]
                if todo and (self.lane.closed or self.tier.down):
                    return False
                room = max(0, self._max_pending - self.lane.puts_pending)
                for key in todo[:room]:
                    slot = host.slot_of(key)
                    if slot is None or self._queue(key, slot):
                        tried.add(key)
            if not todo:  # every chunk tried: not all written if the store went down meanwhile
                with self._lock:
                    return not (self.tier.down and any(key not in self._known for key in tried))
            self.start()
        return False

    def close(self, timeout: float) -> bool:
        return self.lane.close(timeout)


def open_store_remote(config: KVTierConfig, namespace: Namespace, raw_bytes: int,
                      host: HostTier | None, stack: TierStack, stats: StoreStats,
                      failures: FailureLog, lock: threading.Lock) -> StoreRemote | None:
    """The store's remote tier, or None without ``remote_url`` (``ConfigError`` when there is
    one and no host tier to read its chunks into)."""
    tier = open_remote(config, namespace, raw_bytes)
    if tier is None:
        return None
    if host is None:
        tier.close()
        raise ConfigError("kvtier config: remote_url needs host memory to stage chunks in: "
                          "raise host_capacity to at least one chunk")
    queued = max(1, min(host.num_slots // 2, QUEUED_BYTES // max(1, raw_bytes)))
    return StoreRemote(tier, config, host, stack, stats, failures, lock, queued)
