"""How far a producer's hand-off reaches: the prompt tokens whose chunks are in the pool.

A consumer waits, up to ``load_timeout``, for every token a hand-off names. So a producer
names only the leading chunks that are in the pool or on their way there: on its disk
when that is a shared directory other engines follow (held, or a write to it in flight),
in another engine's segment of that directory (a chunk this engine loaded from there: the
consumer reads it there too), or in the remote store (known there, or a write to it in
flight). A chunk found cached in host memory only (its disk write failed, no disk slot
was free, its remote write was dropped) ends the hand-off there: the consumer computes the
rest at once instead of waiting for a chunk that is not coming.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.config.settings import KVTierConfig
from kvtier.connector.scheduler.records import PendingStores, Tracked
from kvtier.connector.scheduler.remote_writes import RemoteWrites
from kvtier.keys import ChunkKey
from kvtier.shared.follower import OtherWriters
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import TierStack


def shares_directory(config: KVTierConfig) -> bool:
    """Whether this engine's disk tier is a segment of a directory other engines follow."""
    return bool(config.disk_paths) and config.share_writers > 1 and config.share_refresh is not None


class PoolReach:
    """Contract: ``holds(key)`` says whether a chunk is in the pool or on its way there;
    ``tokens(tracked, keys)`` is how many of a request's prompt tokens its hand-off names:
    those of its offered chunks (``keys``: its first ``tracked.stored_upto``, in order, then
    its tail where offered) up to the first the pool does not hold."""

    def __init__(self, config: KVTierConfig, stack: TierStack, pending: PendingStores,
                 remote_writes: RemoteWrites | None, chunk_tokens: int,
                 others: OtherWriters | None = None) -> None:
        self._disk = stack.indexes.get(TierName.DISK) if shares_directory(config) else None
        self._pending, self._remote, self._chunk = pending, remote_writes, chunk_tokens
        self._others = others

    def holds(self, key: ChunkKey) -> bool:
        if self._disk is not None:
            planned = self._pending.host.get(key)
            if key in self._disk or key in self._pending.disk \
                    or (planned is not None and planned[1] is not None):
                return True
            if self._others is not None and self._others.find(key) is not None:
                return True
        return self._remote is not None and self._remote.holds(key)

    def tokens(self, tracked: Tracked, keys: Sequence[ChunkKey]) -> int:
        offered = tracked.offered_tokens(self._chunk)
        held = 0
        for key in keys[:tracked.stored_upto]:
            if not self.holds(key):
                return held * self._chunk
            held += 1
        tail = tracked.tail
        if offered > held * self._chunk and tail is not None and not self.holds(tail.key):
            return held * self._chunk
        return offered
