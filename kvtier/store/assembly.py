"""A ``KVStore``'s parts, opened in order: its memory tiers, its disk lane and what the disk
holds, the bookkeeping over them, what runs puts, gets and flushes, and what other writers
and a remote store hold; closed in the order that leaves no I/O on freed memory. A start
that fails gives back everything it had taken."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from kvtier.config.settings import KVTierConfig
from kvtier.disk.lane import DiskLane, NoDisk, open_lane
from kvtier.disk.retry import OnBack
from kvtier.io.engine import EngineFactory
from kvtier.keys import Namespace
from kvtier.layout import DTYPE_BYTES, KVLayout
from kvtier.logs import FailureLog
from kvtier.shared.follower import OtherWriters, follow_others
from kvtier.shared.reads import other_reads
from kvtier.store.books import open_books
from kvtier.store.checks import check_tiers
from kvtier.store.disk_writes import write_queue_bound
from kvtier.store.flush import Flusher
from kvtier.store.gate import CallGate
from kvtier.store.reads import Fetcher
from kvtier.store.remote import open_store_remote
from kvtier.store.state import StoreState
from kvtier.store.sync_watch import SyncedIndex
from kvtier.store.transfers import Transfers
from kvtier.store.writes import PlanRunner
from kvtier.tiers.base import MemoryTier, TierName
from kvtier.tiers.gpu import DevicePool
from kvtier.tiers.host import HostTier, make_host_tier
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.policy import make_policy

GPU, HOST, DISK = TierName.GPU, TierName.HOST, TierName.DISK
log = logging.getLogger("kvtier")


@dataclass(frozen=True)
class StoreShape:
    """What a store's parts are made for."""

    config: KVTierConfig
    layout: KVLayout
    namespace: Namespace
    chunk_bytes: int
    slot_bytes: int


@dataclass
class StoreParts:
    """A store's open parts; ``shared`` is what they all work on."""

    tiers: dict[TierName, MemoryTier] = field(default_factory=dict)
    lane: DiskLane | NoDisk = field(default_factory=NoDisk)
    state: StoreState | None = None
    runner: PlanRunner | None = None
    fetcher: Fetcher | None = None
    flusher: Flusher | None = None
    read_ahead: int = 1

    def close(self, deadline: float, gate: CallGate, timeout: float) -> bool:
        """Close every part once the calls inside ``gate`` are out, at most until ``deadline``
        (``KVStore.close``); False when I/O or a call still runs (a hung drive), which keeps
        the host memory it uses until a later close."""
        state = self.state
        assert state is not None
        if state.remote is not None and not state.remote.close(_left(deadline)):
            self.lane.close(0)  # its I/O uses host memory
            return False
        if not self.lane.close(_left(deadline)):
            return False  # a hung drive: its I/O still uses host memory
        if not gate.close(_left(deadline)):  # they wait no more on I/O: they leave now
            log.error("kvtier KVStore.close: %d calls still running after %g s; host memory "
                      "stays until they end and close() is called again", gate.inside, timeout)
            return False
        if state.others:  # after the lane: no read of another writer's chunk is left
            state.others.close(max(_left(deadline), 0.1))  # an idle refresh ends at once
        state.transfers.close()  # its views of host memory go before the memory
        for tier in self.tiers.values():
            tier.close()
        return True

    def release(self) -> None:
        """Give back what a start that failed had taken (nothing is running yet)."""
        state = self.state
        if state and state.others:
            state.others.close()
        if state and state.remote:
            state.remote.close(0)
        self.lane.close(0)
        if state is not None:  # its views of host memory go before the memory
            state.transfers.close()
        for tier in self.tiers.values():
            tier.close()


def open_parts(shape: StoreShape, device: torch.device | str | None,
               io_engine: EngineFactory) -> StoreParts:
    """Every part of a store, or what was taken given back and the error raised."""
    parts = StoreParts()
    try:
        _open_tiers(parts, shape, device)
        _open_bookkeeping(parts, shape, io_engine)
        _recover(parts, shape.config.io_threads)
        _open_beyond(parts, shape)
    except BaseException:
        parts.release()
        raise
    return parts


def _open_tiers(parts: StoreParts, shape: StoreShape, device: torch.device | str | None) -> None:
    cfg, slot_bytes = shape.config, shape.slot_bytes
    if cfg.gpu_capacity >= slot_bytes:
        parts.tiers[GPU] = DevicePool(cfg.gpu_capacity // slot_bytes, slot_bytes, device)
    if cfg.host_capacity >= slot_bytes:
        parts.tiers[HOST] = make_host_tier(cfg.host_capacity, slot_bytes)
    check_tiers(cfg, set(parts.tiers), cfg.chunk_tokens, slot_bytes)


def _open_bookkeeping(parts: StoreParts, shape: StoreShape, io_engine: EngineFactory) -> None:
    cfg, layout = shape.config, shape.layout

    def lane(lock: threading.Lock, on_back: OnBack, failures: FailureLog) -> DiskLane | NoDisk:
        # write-back moves get their own queue per path: a put or get waiting on one must
        # not queue behind background writes and read-ahead
        parts.lane = open_lane(cfg, shape.namespace, shape.chunk_bytes, DTYPE_BYTES[layout.dtype],
                               lock=lock, on_back=on_back, failures=failures, move_lanes=True,
                               engine_factory=io_engine)
        return parts.lane

    synced: list[SyncedIndex] = []  # the disk tier's index, which flushes watch

    def levels(lane: DiskLane | NoDisk) -> list[tuple[TierName, SlotIndex]]:
        policy = cfg.eviction_policy
        found = [(name, SlotIndex(t.num_slots, make_policy(policy))) for name, t in parts.tiers.items()]
        synced.append(SyncedIndex(lane.num_slots, make_policy(policy), lane.queue_of))
        return [*found, (DISK, synced[0])]  # 0 slots without disk

    books = open_books(lane, levels)
    transfers = Transfers(parts.tiers, parts.lane.tier, shape.chunk_bytes,
                          getattr(torch, layout.dtype), layout.shape(cfg.chunk_tokens))
    host_slots = parts.tiers[HOST].num_slots if HOST in parts.tiers else 0
    max_pending = write_queue_bound(cfg, host_slots, len(parts.lane.queues))
    parts.state = state = StoreState(cfg, books, parts.lane, transfers, parts.tiers, max_pending)
    parts.runner = PlanRunner(state)
    parts.fetcher = Fetcher(state, parts.runner)
    parts.flusher = Flusher(state, parts.runner, synced[0])
    parts.read_ahead = max(1, min(2 * cfg.io_threads, host_slots // 2 if host_slots else 1))


def _recover(parts: StoreParts, threads: int) -> None:
    """What the disk holds."""
    assert parts.state is not None
    report = parts.lane.recover(threads=threads)
    parts.state.books.adopt(report.slots, report.torn)


def _open_beyond(parts: StoreParts, shape: StoreShape) -> None:
    """Other writers of a shared directory, and the remote store."""
    state = parts.state
    assert state is not None
    host = parts.tiers.get(HOST)
    host = host if isinstance(host, HostTier) else None
    others = _follow_others(shape, parts.lane, host)
    if others is not None:  # another writer's chunk is never copied into this segment
        state.books.elsewhere(state.held_elsewhere)
    state.others = others
    state.remote = open_store_remote(shape.config, shape.namespace, shape.chunk_bytes, host,
                                     state.books)


def _follow_others(shape: StoreShape, lane: DiskLane | NoDisk,
                   host: HostTier | None) -> OtherWriters | None:
    """The other writers of the store's namespace on its disk paths, followed, or None: no
    disk tier, no host tier to read their chunks into, or ``share_refresh`` off."""
    if not isinstance(lane, DiskLane) or host is None:
        return None
    paths = lane.tier.paths  # a segment of its own on a path once it holds one there
    reads = other_reads(shape.config, shape.namespace, shape.chunk_bytes, lane)
    return follow_others(shape.config, [shape.namespace], shape.chunk_bytes,
                         lambda: [paths.own], reads)


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
