"""The other writers of a store's namespace on its disk paths (one directory shared by many
engines): what they hold, kept fresh by a thread, and reads of it into host slots."""

from __future__ import annotations

import logging
import threading

from kvtier.config import KVTierConfig
from kvtier.io.result import IOResult
from kvtier.keys import ChunkKey, Namespace
from kvtier.tier_stack import Location
from kvtier.tiers.disk_lane import DiskLane, NoDisk
from kvtier.tiers.foreign_reads import ForeignReads
from kvtier.tiers.host import HostTier
from kvtier.tiers.shared_view import ForeignChunk, SharedView, WriterState

log = logging.getLogger("kvtier")


class OtherWriters:
    """Contract: ``find(key)`` says where another writer holds ``key`` (None: nowhere, as of
    the last refresh); ``read_many(items)`` reads such chunks into host slots, verified
    (blocking: run it on an I/O thread), results never exceptions; ``drop(chunk)`` forgets a
    copy that failed. The view is refreshed once when made, then every ``share_refresh``
    seconds by a daemon thread until ``close``; a refresh that fails is logged once and
    tried again next time."""

    def __init__(self, config: KVTierConfig, namespace: Namespace, raw_bytes: int,
                 lane: DiskLane, host: HostTier) -> None:
        tier = lane.tier
        self.view = SharedView(config.disk_paths, namespace, raw_bytes, tier.writer,
                               config.lease_timeout)
        o_direct = [p.dir.o_direct if p.dir is not None else False for p in tier.paths.states]
        self._reads = ForeignReads(config.disk_paths, namespace, raw_bytes, tier.stride,
                                   self.view, o_direct)
        self._host = host
        self._every = config.share_refresh or 1.0
        self._stop = threading.Event()
        self._failed_once = False
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="kvtier-share", daemon=True)
        self._thread.start()

    def find(self, key: ChunkKey) -> ForeignChunk | None:
        return self.view.find(key)

    def drop(self, chunk: ForeignChunk) -> None:
        self.view.drop(chunk)

    def writers(self) -> list[WriterState]:
        return self.view.writers()

    def read_many(self, items: list[tuple[ForeignChunk, Location]]) -> list[IOResult]:
        return [self._reads.read(chunk, self._host.slot_array(dst.slot)) for chunk, dst in items]

    def refresh(self) -> None:
        try:
            self.view.refresh()
        except Exception as exc:  # a bug or an unforeseen error: the view is only stale
            if not self._failed_once:
                log.warning("kvtier: looking at other writers' segments failed: %r (tried "
                            "again every %g s; further failures are not logged)", exc, self._every)
            self._failed_once = True

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.view.close()
        self._reads.close()


def open_others(config: KVTierConfig, namespace: Namespace, raw_bytes: int,
                lane: DiskLane | NoDisk, host: HostTier | None) -> OtherWriters | None:
    """Followers of the other writers, or None: no disk tier, no host tier to read into, or
    ``share_refresh`` off (a private cache)."""
    if config.share_refresh is None or not isinstance(lane, DiskLane) or host is None:
        return None
    return OtherWriters(config, namespace, raw_bytes, lane, host)
