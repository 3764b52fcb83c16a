"""``Books``: a store's bookkeeping and the one lock over it. The tier stack (which slot
holds which chunk, pins, reservations), the counters and the failure log are reached only
through it; bytes move outside the lock."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from kvtier.disk.lane import DiskLane, NoDisk
from kvtier.disk.recovery import RecoveredSlot
from kvtier.disk.retry import OnBack
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.logs import FailureLog
from kvtier.shared.follower import FollowedCounts
from kvtier.store import adoption
from kvtier.store.skip import Skip
from kvtier.store.stats import StoreStats
from kvtier.tiers.base import TierName
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.path_adoption import PathAdoption
from kvtier.tiers.prefix import InOther, Ours, find, walk_cached
from kvtier.tiers.stack import Location, StorePlan, TierStack

DISK = TierName.DISK
Lane = DiskLane | NoDisk
AdoptSome = Callable[[], bool]  # adopts a share of a path's chunks: whether some are left
Pins = Iterable[tuple[ChunkKey, Location]]


class Held:
    """The bookkeeping with the store's lock held: what ``Books.held()`` yields, valid
    inside that ``with`` only. ``stack``, ``stats`` and ``failures`` are read and changed
    freely there; the methods are the steps the parts share."""

    __slots__ = ("_lane", "_lock", "adoption", "failures", "stack", "stats")

    def __init__(self, stack: TierStack, stats: StoreStats, failures: FailureLog, lane: Lane,
                 lock: threading.Lock) -> None:
        self.stack, self.stats, self.failures = stack, stats, failures
        self._lane, self._lock = lane, lock
        self.adoption = PathAdoption(stack.indexes[DISK]) if DISK in stack.indexes else None
        if self.adoption is not None:
            stack.on_discard = self.adoption.discarded

    def __enter__(self) -> Held:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def count(self, name: str, n: int = 1) -> None:
        setattr(self.stats, name, getattr(self.stats, name) + n)

    def account_write(self, result: IOResult) -> None:  # a disk write's outcome
        if result.ok:
            self.stats.disk_writes += 1
            self.stats.disk_write_bytes += result.nbytes
        else:
            self.account_failure(result, "write")

    def account_failure(self, result: IOResult, op: str) -> None:
        """Count and log (once per kind) a failed disk request."""
        counter = self._lane.note_failure(result, op)
        if result.status is IOStatus.PATH_DOWN:
            self.retire_down_paths()  # the disk tier logged it, once per path
        elif counter is not None:
            self.count(counter)

    def retire_down_paths(self) -> None:
        """Take the slots of paths that went out of service away from the disk index."""
        for index, reason in self._lane.newly_down().items():
            self.stats.paths_down[self._lane.roots[index]] = reason
            if self.adoption is not None:
                self.adoption.path_out(index)  # its chunks waiting go out with it
            self.stack.indexes[DISK].retire(self._lane.slots_of_path(index))

    def path_back(self, index: int, found: Sequence[RecoveredSlot] = ()) -> AdoptSome | None:
        """A disk path came back, holding ``found`` (empty unless it was out since the
        start: ``DiskRetries``, newest first): the call that adopts them, then puts its
        other slots back in service, a share a lock hold (``PathAdoption``), taking the
        lock, and says whether some is left; None without a disk tier."""
        self.stats.paths_back += 1
        self.stats.paths_down.pop(self._lane.roots[index], None)
        if self.adoption is None:
            return None
        self.adoption.start(index, self._lane.slots_of_path(index),
                            ((r.header.key, r.slot) for r in found))
        return self._adopt_some

    def _adopt_some(self) -> bool:
        with self:
            assert self.adoption is not None
            self.stats.recovered_chunks += len(self.adoption.step(adoption.ADOPT_PER_HOLD))
            return self.adoption.waiting


class Books:
    """The bookkeeping of one ``KVStore`` and the one lock over it.

    Contract: each method below takes the lock itself, once, for one operation, and
    returns plain values (never a live view of the bookkeeping). Where several steps must
    happen together, or a part's own state is guarded by the same lock (a ``get``'s
    stagings, the writes queued for the remote store), ``with books.held() as b:`` (a
    ``Held``) is the only other way in; keep such blocks few and short, and take one for a
    run of chunks rather than one per chunk. The lock is shared once, at open, with the disk
    lane (``open_books``), whose path retries call ``path_back`` with it held. ``slots``,
    each tier's slot count, never changes and needs no lock.
    """

    def __init__(self, stack: TierStack, lane: Lane | None = None,
                 stats: StoreStats | None = None, failures: FailureLog | None = None,
                 lock: threading.Lock | None = None) -> None:
        """``lock``: only ``open_books``, which shares it with the lane, passes one."""
        self._lock = lock or threading.Lock()
        self._stack, self._lane = stack, lane or NoDisk()
        if isinstance(self._lane, DiskLane):  # a write's stamp in the order writes are planned
            stack.on_disk_reserved = self._lane.tier.stamps.reserve
        self._stats = StoreStats() if stats is None else stats
        self._failures = FailureLog() if failures is None else failures
        self._held = Held(self._stack, self._stats, self._failures, self._lane, self._lock)
        self.slots = {name: index.num_slots for name, index in stack.indexes.items()}
        self.top = stack.order[0]

    def held(self) -> Held:
        """The lock, held for the ``with`` it opens, and the bookkeeping under it."""
        return self._held

    def path_back(self, index: int, found: Sequence[RecoveredSlot] = ()) -> AdoptSome | None:
        return self._held.path_back(index, found)  # the lane calls it with the lock held

    # -- where chunks are ----------------------------------------------------------------

    def cached(self, keys: Sequence[ChunkKey], theirs: Callable[[ChunkKey], Any] | None
               ) -> list[Ours | InOther]:
        """The longest prefix of ``keys`` held here or by another writer (``theirs``)."""
        with self._lock:
            return walk_cached(keys, self._stack.locate, theirs)

    def find(self, key: ChunkKey, theirs: Callable[[ChunkKey], Any] | None
             ) -> Ours | InOther | None:
        """Where ``key`` is hottest, here or with another writer (``theirs``); None: neither."""
        with self._lock:
            return find(key, self._stack.locate, theirs)

    def slot_of(self, tier: TierName, key: ChunkKey) -> int | None:
        with self._lock:
            return self._stack.indexes[tier].slot_of(key)

    def census(self, with_disk: bool) -> tuple[dict[str, int], dict[str, int]]:
        """Slots and chunks held per tier (the disk only ``with_disk``)."""
        with self._lock:
            used = {str(name): len(index) for name, index in self._in_use(with_disk)}
        return {str(name): self.slots[name] for name in self.slots
                if name is not DISK or with_disk}, used

    def _in_use(self, with_disk: bool) -> list[tuple[TierName, SlotIndex]]:
        return [(name, index) for name, index in self._stack.indexes.items()
                if name is not DISK or with_disk]

    # -- reservations and pins -----------------------------------------------------------

    def plan_store(self, key: ChunkKey, tier: TierName) -> StorePlan | None:
        with self._lock:
            return self._stack.plan_store(key, tier)

    def plan_promotion(self, key: ChunkKey, tier: TierName,
                       keep: Collection[ChunkKey]) -> StorePlan | None:
        with self._lock:
            return self._stack.plan_promotion(key, tier, keep)

    def plan_put(self, key: ChunkKey) -> StorePlan | Skip:
        """A plan to store ``key`` in the top tier, or why there is none (a chunk cached, or
        being written to the top tier, is only marked recent)."""
        with self._lock:
            stack = self._stack
            if stack.locate(key) is not None or stack.indexes[self.top].has_entry(key):
                stack.touch(key)
                return Skip.PRESENT
            return stack.plan_store(key, self.top) or Skip.NO_ROOM

    def abort(self, reservations: Pins) -> None:
        """Fail each reservation (key, slot reserved)."""
        with self._lock:
            for key, dst in reservations:
                self._stack.finish(key, dst, False)

    def pin_prefix(self, keys: Sequence[ChunkKey], tier: TierName) -> list[tuple[ChunkKey, Location]]:
        with self._lock:
            return self._stack.pin_prefix(keys, tier)

    def unpin(self, pins: Pins) -> None:  # each pin, all under one hold of the lock
        with self._lock:
            for key, loc in pins:
                self._stack.unpin(key, loc)

    def hold(self, tier: TierName, key: ChunkKey) -> bool:
        """Pin ``key``'s slot in ``tier`` even if it is dropped meanwhile (``SlotIndex.hold``)."""
        with self._lock:
            return self._stack.indexes[tier].hold(key)

    def discard(self, key: ChunkKey) -> int:
        with self._lock:
            return self._stack.discard(key)

    # -- counters and failures -----------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._held.count(name, n)

    def failed(self, counter: str, kind: str, detail: str) -> None:
        """Count a failure in ``counter`` and log it once per ``kind``."""
        with self._lock:
            self._held.count(counter)
            self._failures.note(kind, detail)

    def verified(self, checked: int, wrong: Sequence[TierName]) -> None:
        """A check against fresh KV: ``checked`` chunks, those ``wrong`` by their tier."""
        with self._lock:
            self._held.stats.chunks_verified += checked
            self._held.stats.verify_mismatches.update(wrong)

    def got(self, loaded: Sequence[TierName], wanted: int) -> None:
        """What one ``get`` loaded (by tier) of the ``wanted`` chunks."""
        with self._lock:
            self._stats.chunks_loaded.update(loaded)
            self._stats.chunks_missed += wanted - len(loaded)

    def account_write(self, result: IOResult) -> None:
        with self._lock:
            self._held.account_write(result)

    def timed_out(self, slot: int, kind: str, detail: str, given_up: bool = True) -> None:
        """Count (``load_timeouts``, unless still going on: not ``given_up``) and log once
        an I/O not over after ``load_timeout``; it counts against its path's health too."""
        went_down = self._lane.note_timeout(slot)
        with self._lock:
            self._stats.load_timeouts += given_up
            self._failures.note(kind, detail)
            if went_down:
                self._held.retire_down_paths()

    def retire_down_paths(self) -> None:
        with self._lock:
            self._held.retire_down_paths()

    def snapshot(self, with_disk: bool, shared: FollowedCounts | None = None,
                 remote: tuple[bool, int] | None = None) -> StoreStats:
        """A copy of the counters, with the tiers' evictions, demotions and drops, paths out
        of service retired first; ``shared``: other writers' counts as last seen;
        ``remote``: whether the remote store is out of service, and how many of its nodes
        are alone."""
        with self._lock:
            stats = self._stats
            stats.evictions = {str(n): i.evictions for n, i in self._in_use(with_disk)}
            stats.demotions, stats.drops = self._stack.demotions, self._stack.drops
            self._held.retire_down_paths()
            if shared is not None:
                stats.take_followed(shared)
            if remote is not None:
                stats.remote_down, stats.remote_nodes_out = remote
            return stats.snapshot()

    # -- at open -------------------------------------------------------------------------

    def adopt(self, found: Iterable[RecoveredSlot], torn: int) -> None:
        """What the disk holds at start, oldest first (evicted first)."""
        with self._lock:
            self._stats.recovered_chunks = adoption.adopt(self._stack.indexes[DISK], found)
            self._stats.torn_slots = torn
            self._held.retire_down_paths()

    def elsewhere(self, on_disk: Callable[[ChunkKey], bool]) -> None:
        """A victim bound for disk that ``on_disk`` says is on disk elsewhere is dropped."""
        with self._lock:
            self._stack.on_disk_elsewhere = on_disk


LaneOpener = Callable[[threading.Lock, OnBack, FailureLog], Lane]


def open_books(open_lane: LaneOpener,
               levels: Callable[[Lane], list[tuple[TierName, SlotIndex]]]) -> Books:
    """A store's books over the lane ``open_lane(lock, on_back, failures)`` opens, sharing
    their lock (its path retries call ``on_back`` with it held) and failure log;
    ``levels(lane)``: the tiers' indexes, hottest first."""
    lock, failures = threading.Lock(), FailureLog()
    opened: list[Books] = []

    def on_back(index: int, found: list[RecoveredSlot]) -> AdoptSome | None:
        return opened[0].path_back(index, found) if opened else None

    lane = open_lane(lock, on_back, failures)
    opened.append(Books(TierStack(levels(lane)), lane, StoreStats(), failures, lock))
    return opened[0]
