"""The other writers of a store's namespace on its disk paths (one directory shared by many
engines): what they hold, kept fresh by a thread, and reads of it into host slots."""

from __future__ import annotations

from kvtier.config.settings import KVTierConfig
from kvtier.disk.lane import DiskLane, NoDisk
from kvtier.io.result import IOResult
from kvtier.keys import ChunkKey, Namespace
from kvtier.shared.followed import ForeignChunk, WriterState, directory_slots
from kvtier.shared.reads import foreign_reads
from kvtier.shared.refresh import RefreshThread
from kvtier.shared.view import SharedView
from kvtier.tiers.host import HostTier
from kvtier.tiers.stack import Location


class OtherWriters:
    """Contract: ``find(key)`` says where another writer holds ``key`` (None: nowhere, as of
    the last refresh); ``read_many(items)`` reads such chunks into host slots, verified
    (blocking: run it on an I/O thread), results never exceptions; ``drop(chunk)`` forgets a
    copy that failed. The view is refreshed once when made, then every ``share_refresh``
    seconds (``RefreshThread``) until ``close``."""

    def __init__(self, config: KVTierConfig, namespace: Namespace, raw_bytes: int,
                 lane: DiskLane, host: HostTier) -> None:
        tier = lane.tier
        self.view = SharedView(config.disk_paths, namespace, raw_bytes, tier.writer,
                               config.lease_timeout, directory_slots(
                                   raw_bytes, len(config.disk_paths), config.disk_capacity))
        reads = foreign_reads(config, namespace, raw_bytes, lane)
        assert reads is not None, "a store with a disk lane and share_refresh on reads others"
        self._reads = reads
        self._host = host
        self._tier = tier
        self.view.refresh()
        self._thread = RefreshThread(self._refresh, config.share_refresh or 1.0)

    def _refresh(self) -> None:
        self.view.own = self._tier.writer  # it may take another id when its path comes back
        self.view.refresh()
        self._reads.sweep()  # files of segments reclaimed since: their space goes back

    def find(self, key: ChunkKey) -> ForeignChunk | None:
        return self.view.find(key)

    def drop(self, chunk: ForeignChunk) -> None:
        self.view.drop(chunk)

    def writers(self) -> list[WriterState]:
        return self.view.writers()

    def read_many(self, items: list[tuple[ForeignChunk, Location]]) -> list[IOResult]:
        return self._reads.read_many([(self.view.ref(chunk), self._host.slot_array(dst.slot))
                                      for chunk, dst in items])

    def close(self) -> None:
        self._thread.close()
        self.view.close()
        self._reads.close()


def open_others(config: KVTierConfig, namespace: Namespace, raw_bytes: int,
                lane: DiskLane | NoDisk, host: HostTier | None) -> OtherWriters | None:
    """Followers of the other writers, or None: no disk tier, no host tier to read into, or
    ``share_refresh`` off (a private cache)."""
    if config.share_refresh is None or not isinstance(lane, DiskLane) or host is None:
        return None
    return OtherWriters(config, namespace, raw_bytes, lane, host)
