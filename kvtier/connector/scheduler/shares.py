"""Other engines' chunks in a shared directory, as the scheduler side sees them.

Each TP rank writes its own namespace's segment; another engine's chunk is loadable only
when every rank's segment of that engine holds it in the same slot (the slots an engine's
ranks write are chosen once, by its scheduler side, for all of them).
"""

from __future__ import annotations

from kvtier.config.settings import KVTierConfig
from kvtier.keys import ChunkKey, Namespace
from kvtier.shared.followed import directory_slots
from kvtier.shared.reads import SlotRef
from kvtier.shared.refresh import RefreshThread
from kvtier.shared.view import SharedView


class EngineShares:
    """Contract: ``find(key)`` returns, for each rank in order, where another engine holds
    ``key`` (None when no engine holds it in the same slot on every rank, as of the last
    refresh); ``drop(refs)`` forgets such a copy (a rank failed to read it). The views are
    refreshed once when made, then every ``share_refresh`` seconds until ``close``."""

    def __init__(self, config: KVTierConfig, namespaces: list[Namespace], raw_bytes: int,
                 writers: list[str]) -> None:
        slots = directory_slots(raw_bytes, len(config.disk_paths), config.disk_capacity)
        self.views = [SharedView(config.disk_paths, ns, raw_bytes, writer, config.lease_timeout,
                                 slots)
                      for ns, writer in zip(namespaces, writers, strict=True)]
        self.refresh()
        self._thread = RefreshThread(self.refresh, config.share_refresh or 1.0)

    def refresh(self) -> None:
        for view in self.views:
            view.refresh()

    def find(self, key: ChunkKey) -> tuple[SlotRef, ...] | None:
        first = self.views[0].find(key)
        if first is None:
            return None
        chunks = [first]
        for view in self.views[1:]:
            chunk = view.find_at(key, first.writer, first.path, first.slot)
            if chunk is None:
                return None
            chunks.append(chunk)
        return tuple(view.ref(chunk) for view, chunk in zip(self.views, chunks, strict=True))

    def drop(self, refs: tuple[SlotRef, ...]) -> None:
        for view, ref in zip(self.views, refs, strict=True):
            chunk = view.find_at(ChunkKey(ref.key), ref.writer, ref.path, ref.slot)
            if chunk is not None:
                view.drop(chunk)

    def __len__(self) -> int:
        return len(self.views[0])

    def metric_samples(self) -> list:
        """The shared directory's metrics: rank 0's view of chunks and writers, and the
        segments reclaimed and seats given back by every rank's view."""
        from kvtier.store.stats import shared_samples

        return shared_samples(len(self.views[0]), len(self.views[0].writers()),
                              sum(v.reclaimed for v in self.views),
                              sum(v.seats_freed for v in self.views))

    def close(self) -> None:
        self._thread.close()
        for view in self.views:
            view.close()


def open_shares(config: KVTierConfig, namespaces: list[Namespace], raw_bytes: int,
                writers: list[str]) -> EngineShares | None:
    """The scheduler side's view of other engines (``writers``: this engine's writer id of
    each rank, whose segments are its own), or None (no disk paths, or ``share_refresh``
    off)."""
    if not config.disk_paths or config.share_refresh is None:
        return None
    return EngineShares(config, namespaces, raw_bytes, writers)
