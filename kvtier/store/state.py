"""What the parts of a ``KVStore`` share: the configuration, the bookkeeping and its one
lock, the tiers, the disk lane, the counters, and the accounting of I/O outcomes."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

from kvtier.config.settings import KVTierConfig
from kvtier.disk.lane import DiskLane, NoDisk
from kvtier.io.result import IOResult, IOStatus
from kvtier.logs import FailureLog
from kvtier.store.stats import StoreStats
from kvtier.store.transfers import Transfers
from kvtier.tiers.base import MemoryTier, TierName
from kvtier.tiers.stack import TierStack

if TYPE_CHECKING:
    from kvtier.shared.follower import OtherWriters
    from kvtier.store.remote import StoreRemote

GPU, HOST, DISK, SHARED = TierName.GPU, TierName.HOST, TierName.DISK, TierName.SHARED
REMOTE = TierName.REMOTE


class Skip(Enum):
    """Why a chunk was not planned (``put``) or fetched (``get``)."""

    PRESENT = "present"  # put: cached already, or being written
    NO_ROOM = "no room"  # no slot free now
    BUSY = "busy"  # get: another get is reading it into host memory: wait for that
    END = "end"  # get: not cached, or its staging slot could not be written back in time


@dataclass
class StoreState:
    """The state every part of one store works on. Bookkeeping (``stack``) and counters
    change only with ``lock`` held; bytes move outside it."""

    config: KVTierConfig
    lock: threading.Lock
    stack: TierStack
    top: TierName
    lane: DiskLane | NoDisk
    transfers: Transfers
    stats: StoreStats
    failures: FailureLog
    tiers: dict[TierName, MemoryTier]
    max_pending: int  # background disk writes queued per path before write-through drops
    others: OtherWriters | None = None  # other writers of a shared directory, when followed
    remote: StoreRemote | None = None  # the remote tier (remote_url)

    def timed_out(self, slot: int, kind: str, detail: str) -> None:
        """Count (``load_timeouts``) and log once an I/O given up on after ``load_timeout``;
        it counts against its path's health too."""
        went_down = self.lane.note_timeout(slot)
        with self.lock:
            self.stats.load_timeouts += 1
            self.failures.note(kind, detail)
            if went_down:
                self.retire_down_paths()

    def account_write(self, result: IOResult) -> None:
        if result.ok:
            self.stats.disk_writes += 1
            self.stats.disk_write_bytes += result.nbytes
        else:
            self.account_failure(result, "write")

    def account_failure(self, result: IOResult, op: str) -> None:
        """Count and log (once per kind) a failed disk request (lock held)."""
        counter = self.lane.note_failure(result, op)
        if result.status is IOStatus.PATH_DOWN:
            self.retire_down_paths()  # the disk tier logged it, once per path
        elif counter is not None:
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    def path_back(self, index: int) -> None:
        """A disk path came back into service, empty (lock held)."""
        self.stats.paths_back += 1
        self.stats.paths_down.pop(self.lane.roots[index], None)
        self.stack.indexes[DISK].unretire(self.lane.slots_of_path(index))

    def retire_down_paths(self) -> None:
        """Take the slots of paths that went out of service away from the index (lock held)."""
        for index, reason in self.lane.newly_down().items():
            self.stats.paths_down[self.lane.roots[index]] = reason
            self.stack.indexes[DISK].retire(self.lane.slots_of_path(index))

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def sync(self) -> None:
        gpu = self.tiers.get(GPU)
        if gpu is not None and gpu.device.type == "cuda":
            torch.cuda.synchronize(gpu.device)
