"""The remote tier as one ``KVStore`` uses it: which chunks the store holds (asked once per
call), chunks read into host slots on the tier's threads, and chunks that reached host
memory written to it in the background (every one, or those loaded ``remote_min_hits``
times), each keeping its host slot pinned until the store answered."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.config.remote_url import backend_of
from kvtier.config.settings import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.base import RemoteTier
from kvtier.remote.known import KNOWN_MIN, HitCounts, KnownKeys
from kvtier.remote.lane import RemoteLane, RemotePut, writes_in_flight
from kvtier.remote.opening import open_remote
from kvtier.store.books import Books, Held
from kvtier.tiers.base import TierName
from kvtier.tiers.host import HostTier
from kvtier.tiers.stack import Location
from kvtier.units import time_left

HOST = TierName.HOST
CHECK_BATCH = 1024  # keys asked about in one round trip when a flush checks what the store lost


@dataclass(frozen=True)
class RemoteFlush:
    """What a remote store's flush came to: ``not_written``, the chunks it was asked to
    write that it does not hold (writes refused or failed since the last flush, and every
    host chunk it is not known to hold: with ``remote_min_hits`` above 0, of those it held
    once and lost), and whether the flush stopped at its deadline. True when neither."""

    not_written: int
    timed_out: bool = False

    def __bool__(self) -> bool:
        return self.not_written == 0 and not self.timed_out


class StoreRemote:
    """The remote tier of one ``KVStore``.

    Contract (methods marked "lock held" run under the store's lock and are given its
    ``Held``; the rest take it, through ``Books.held``, when they need it):

    - ``held(keys)``: whether the store holds each of ``keys``: one round trip, blocking
      (nothing while the tier is out of service or the trip failed; the prefix walk goes on
      through each chunk it holds or this store caches, ``walk_remote``). A key the store
      answers "not there" is no longer known to be held (a restart or an eviction lost
      it): its next store writes it again.
    - ``reached_host(b, key, slot)`` (lock held): a chunk became visible in host slot
      ``slot``; with ``remote_min_hits`` 0 its write is queued. ``loaded(key, slot)``: a
      get served a chunk held in host slot ``slot``; at its ``remote_min_hits``-th load (with
      0: at any load, when a write of it was dropped or failed) its write is queued.
      ``start()`` (lock not held) submits the writes queued.
    - ``get(pairs)`` (on ``lane``'s threads): chunks read into host slots, verified;
      ``read_over(b, key, result)`` (lock held) counts what came of one.
    - A queued write pins its host slot until the store answered; chunks the store holds
      (written, or read from it) are not written again while remembered (``KnownKeys``).
      Writes are dropped, and counted, past ``max_pending`` queued (each holds a host slot).
      A write the store refuses (full) or that fails is not written: forgotten, and
      reported by the next ``flush``.
    - ``flush(deadline)`` asks the store whether it still holds the host chunks it is known
      to hold, writes those it lost and what ``reached_host`` could not queue, and waits:
      a ``RemoteFlush``;
      ``drain(timeout)`` waits for reads and writes; ``close(timeout)`` as ``RemoteLane``.
    """

    def __init__(self, tier: RemoteTier, config: KVTierConfig, host: HostTier, books: Books,
                 max_pending: int) -> None:
        self.tier, self.backend = tier, backend_of(config.remote_url or "")
        self._host, self._books, self._max_pending = host, books, max_pending
        self._min_hits = config.remote_min_hits
        slots = sum(books.slots.values())
        self._known = KnownKeys(max(KNOWN_MIN, 2 * slots))
        self._hits = HitCounts(max(KNOWN_MIN, 2 * slots))
        self._refused = KnownKeys(max(KNOWN_MIN, 2 * slots))  # not written since the last flush
        self._writing: set[ChunkKey] = set()  # queued, not answered yet
        self._wrong: set[ChunkKey] = set()  # of those, found wrong meanwhile: removed once over
        self._groups: list = []  # put jobs opened under the lock, started once it is released
        tier.register(host.buffer.array)
        self.lane = RemoteLane(tier, config.io_threads, host.slot_array, self._settle)

    def held(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys or self.tier.down:
            return []
        return self._ask(keys) or []

    def _ask(self, keys: Sequence[ChunkKey]) -> list[bool] | None:
        """Which of ``keys`` the store holds (one round trip; None when it failed): a key it
        answers "not there" is forgotten, unless its write is still out; one it refused to
        answer for (a cluster's redirect) is a miss, not a loss."""
        answer = self.tier.exists_answered(keys)
        with self._books.held() as b:
            b.stats.remote_lookups += 1
            if answer is None:  # the round trip failed: "none held"
                b.stats.remote_failures += 1
                return None
            for key, there in zip(keys, answer, strict=True):
                if there is False and key not in self._writing:
                    self._known.discard(key)
        return [there is True for there in answer]

    def reached_host(self, b: Held, key: ChunkKey, slot: int) -> None:
        if not self._min_hits and key not in self._known:
            self._queue(b, key, slot)

    def loaded(self, key: ChunkKey, slot: int) -> None:
        with self._books.held() as b:
            if key in self._known:
                return
            if self._hits.hit(key) < self._min_hits:  # with 0: a write dropped or failed goes again
                return
            self._hits.forget(key)
            self._queue(b, key, slot)

    def _queue(self, b: Held, key: ChunkKey, slot: int) -> bool:
        """Queue the write of a host chunk, its slot pinned (lock held: ``b``; ``start``
        submits it). Not while the tier is out of service; dropped past ``max_pending``. True when
        queued, or when there is nothing to write (the chunk left that slot meanwhile)."""
        if self.lane.closed or self.tier.down:
            return False
        if self.lane.puts_pending >= self._max_pending:
            b.stats.remote_dropped_writes += 1
            b.failures.note("remote write dropped", "the remote write queue is full; the chunk "
                            "is written by flush() or at a later load (counted in "
                            "remote_dropped_writes)")
            return False
        index = b.stack.indexes[HOST]
        pinned = index.pin(key)
        if pinned != slot:  # gone or moved since it was seen there: nothing to write
            if pinned is not None:
                index.unpin(key)
            return True
        self._known.add(key)  # queued: not queued again meanwhile
        self._writing.add(key)
        _, group = self.lane.put(RemotePut(key, slot))
        if group is not None:
            self._groups.append(group)
        return True

    def start(self) -> None:
        """Submit the put jobs queued since the last call (lock not held)."""
        with self._books.held():
            groups, self._groups = self._groups, []
        for group in groups:
            with contextlib.suppress(RuntimeError):  # closed: settled as never run
                self.lane.start(group)

    def _settle(self, items: Sequence[RemotePut], results: Sequence[IOResult] | None) -> None:
        wrong: list[ChunkKey] = []  # written after ``remove`` asked for them gone
        with self._books.held() as b:  # once for the group
            for i, item in enumerate(items):
                b.stack.unpin(item.key, Location(HOST, item.slot))
                self._writing.discard(item.key)
                result = results[i] if results is not None else None
                if item.key in self._wrong:
                    self._wrong.discard(item.key)
                    self._known.discard(item.key)
                    wrong.append(item.key)
                    continue
                if result is not None and result.ok:
                    b.stats.remote_writes += 1
                    b.stats.remote_write_bytes += result.nbytes
                    self._refused.discard(item.key)
                    continue
                self._known.discard(item.key)
                self._refused.add(item.key)
                if result is not None:
                    _failed(b, "write", result)
        if wrong:
            self.tier.remove(wrong)

    def get(self, pairs: Sequence[tuple[ChunkKey, int]]) -> list[IOResult]:
        """Read chunks into host slots, verified: (key, host slot) each; on a remote thread."""
        return self.tier.get_many([key for key, _ in pairs],
                                  [self._host.slot_array(slot) for _, slot in pairs])

    def read_over(self, b: Held, key: ChunkKey, result: IOResult) -> None:
        if result.ok:
            self._known.add(key)
            self._refused.discard(key)
            b.stats.remote_reads += 1
            b.stats.remote_read_bytes += result.nbytes
            return
        if result.status in (IOStatus.MISSING, IOStatus.CORRUPT):  # not there: written again
            self._known.discard(key)  # (a timeout or a redirect is no such news)
        if result.status is IOStatus.MISSING:
            b.stats.remote_misses += 1
        else:
            _failed(b, "read", result)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        """Chunks found wrong (``verify``): removed from the store, not known there; one
        being written is removed again once its write is over."""
        with self._books.held():
            for key in keys:
                self._known.discard(key)
                if key in self._writing:
                    self._wrong.add(key)
        self.tier.remove(keys)

    def drain(self, timeout: float | None) -> bool:
        return self.lane.drain(timeout)

    def flush(self, deadline: float | None) -> RemoteFlush:
        """Forget the host chunks the store lost (``_recheck``), then write the host chunks
        it is not known to hold (with ``remote_min_hits`` 0: writes dropped under
        back-pressure, refused, failed or lost; with more: those it lost, which earned their
        hits before), as many at a time as the queue has room for, each tried once (a write
        other traffic crowded out of the queue is not a try); then wait for every write,
        until ``deadline``. Not written: what the store refused or failed since the last
        flush, and every such host chunk still not known to be held."""
        unchecked: set[ChunkKey] = set()
        lost: set[ChunkKey] = set()
        if self.drain(time_left(deadline)):
            unchecked, lost = self._recheck(deadline)
        tried: set[ChunkKey] = set()
        while self.drain(time_left(deadline)):  # the queue empty: fill it now
            with self._books.held() as b:
                todo = self._unwritten_held(b, tried, lost)
                if todo and (self.lane.closed or self.tier.down):
                    break
                room = max(0, self._max_pending - self.lane.puts_pending)
                host = b.stack.indexes[HOST]
                for key in todo[:room]:
                    slot = host.slot_of(key)
                    if slot is None or self._queue(b, key, slot):
                        tried.add(key)
            if not todo:
                break
            self.start()
        else:
            return self._flushed(True, unchecked, lost)
        return self._flushed(False, unchecked, lost)

    def _unwritten_held(self, b: Held, tried: set[ChunkKey], lost: set[ChunkKey]) -> list[ChunkKey]:
        """Host chunks the store is not known to hold, past ``tried`` (lock held: ``b``); with
        ``remote_min_hits``, only those it ``lost``."""
        visible = b.stack.indexes[HOST].keys()
        return [key for key in visible if key not in self._known and key not in tried
                and (not self._min_hits or key in lost)]

    def _recheck(self, deadline: float | None) -> tuple[set[ChunkKey], set[ChunkKey]]:
        """Ask the store whether it still holds the host chunks it is known to hold,
        ``CHECK_BATCH`` a round trip: a store restarted empty, or evicting, loses them
        without a word, and those it lost are forgotten, so that the flush writes them.
        Returns the keys it could not ask about (the store out of service, or the deadline
        passed: the flush cannot say they are stored) and those it lost."""
        with self._books.held() as b:
            visible = b.stack.indexes[HOST].keys()
            keys = [key for key in visible if key in self._known and key not in self._writing]
        lost: set[ChunkKey] = set()
        for at in range(0, len(keys), CHECK_BATCH):
            left = time_left(deadline)
            batch = keys[at:at + CHECK_BATCH]
            held = None if self.tier.down or (left is not None and left <= 0) else self._ask(batch)
            if held is None:
                return set(keys[at:]), lost
            lost.update(key for key, there in zip(batch, held, strict=True) if not there)
        return set(), lost

    def _flushed(self, timed_out: bool, unchecked: set[ChunkKey],
                 lost: set[ChunkKey]) -> RemoteFlush:
        """What the flush came to; the writes refused since the last flush are reported
        once (those of chunks still held are reported again while not written)."""
        with self._books.held() as b:
            unwritten = set(self._refused) | unchecked
            unwritten.update(self._unwritten_held(b, set(), lost))
            self._refused.clear()
        return RemoteFlush(len(unwritten), timed_out)

    def close(self, timeout: float) -> bool:
        return self.lane.close(timeout)


def open_store_remote(config: KVTierConfig, namespace: Namespace, raw_bytes: int,
                      host: HostTier | None, books: Books) -> StoreRemote | None:
    """The store's remote tier, or None without ``remote_url`` (``ConfigError`` when there is
    one and no host tier to read its chunks into)."""
    tier = open_remote(config, namespace, raw_bytes)
    if tier is None:
        return None
    if host is None:
        tier.close()
        raise ConfigError("kvtier config: remote_url needs host memory to stage chunks in: "
                          "raise host_capacity to at least one chunk")
    queued = writes_in_flight(host.num_slots, raw_bytes)
    return StoreRemote(tier, config, host, books, queued)


def _failed(b: Held, op: str, result: IOResult) -> None:
    """Count and log (once per kind) a failed read or write (lock held: ``b``)."""
    b.stats.remote_failures += 1
    b.failures.note(f"remote {op} {result.status.value}", result.detail)
