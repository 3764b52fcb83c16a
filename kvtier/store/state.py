"""What the parts of a ``KVStore`` share: the configuration, the bookkeeping with its one
lock (``Books``), the tiers, the disk lane, and what other writers and a remote store hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtier.config.settings import KVTierConfig
from kvtier.disk.lane import DiskLane, NoDisk
from kvtier.keys import ChunkKey
from kvtier.store.books import Books
from kvtier.store.transfers import Transfers
from kvtier.tiers.base import MemoryTier, TierName
from kvtier.tiers.stack import Location

if TYPE_CHECKING:
    from kvtier.shared.follower import OtherWriters
    from kvtier.store.remote import StoreRemote

GPU, HOST, DISK, SHARED = TierName.GPU, TierName.HOST, TierName.DISK, TierName.SHARED
REMOTE = TierName.REMOTE


@dataclass
class StoreState:
    """The state every part of one store works on. The bookkeeping, the counters and the
    failure log are ``books``' (its methods take the store's one lock); bytes move outside
    it."""

    config: KVTierConfig
    books: Books
    lane: DiskLane | NoDisk
    transfers: Transfers
    tiers: dict[TierName, MemoryTier]
    max_pending: int  # background disk writes queued per path before write-through drops
    others: OtherWriters | None = None  # other writers of a shared directory, when followed
    remote: StoreRemote | None = None  # the remote tier (remote_url)
    # chunks found wrong while their disk write was in flight (books' lock): the write, once
    # over, blanks its slot and gives it back instead of committing it (``DiskWrites``)
    forgotten: set[ChunkKey] = field(default_factory=set)
    # chunks found wrong while a copy into a memory tier was in flight (a get's read from
    # disk, another writer or the remote store; a promotion): aborted once over, not committed
    unwanted: set[tuple[ChunkKey, TierName]] = field(default_factory=set)

    def was_unwanted(self, key: ChunkKey, dst: Location) -> bool:
        """Whether a copy of ``key`` into memory tier ``dst`` that is now over (committed or
        not: ask once for each) was found wrong while in flight (books' lock held): then it
        is aborted, not committed."""
        if (key, dst.tier) not in self.unwanted:
            return False
        self.unwanted.discard((key, dst.tier))
        return True

    def held_elsewhere(self, key: ChunkKey) -> bool:
        """Whether another writer of the shared directory holds ``key``: never a segment
        under this store's own writer id, which the view may follow while its path comes
        back (the store holds no segment there for a moment), its old slots no copy."""
        refs = None if self.others is None else self.others.find(key)
        return refs is not None and not (isinstance(self.lane, DiskLane)
                                         and refs[0].writer == self.lane.tier.writer)

    def sync(self) -> None:
        gpu = self.tiers.get(GPU)
        if gpu is not None and gpu.device.type == "cuda":
            torch.cuda.synchronize(gpu.device)
