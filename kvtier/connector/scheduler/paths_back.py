"""The disk paths as every rank sees them: a path's slots leave the scheduler side's index
when a first rank takes it out of service, and come back when every rank that did has it
back, with the chunks a path out since the start holds."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtier.connector.common.messages import WorkerReport, found_added, without_paths
from kvtier.connector.scheduler.event_feed import EventFeed
from kvtier.connector.scheduler.rank_counts import RankCount
from kvtier.keys import ChunkKey
from kvtier.segment.index_file import SlotLayout
from kvtier.tiers.base import TierName
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.path_adoption import Adopted, PathAdoption
from kvtier.tiers.stack import TierStack

log = logging.getLogger("kvtier")

ADOPT_PER_STEP = 4096  # chunks adopted per scheduler step at most: no step is held long


class DiskPathsBack:
    """Contract: ``apply(report)`` takes a worker report's disk paths, in this order:

    - out (``paths_down``): when a first rank takes a path out, its slots are retired (its
      chunks leave the index); what ranks found on it so far is forgotten;
    - found (``paths_found``): each rank's chunks on a path back after being out since the
      start (``kvtier.disk.retry.DiskRetries``) are gathered;
    - back (``paths_up``): once every rank that took a path out has it back, its slots come
      back into service and each chunk every rank (``world_size``) found in the same slot is
      adopted (``PathAdoption``: to be evicted before every chunk held, oldest first, unless
      the index holds the key, a copy stored elsewhere meanwhile, or the slot, or the key
      was discarded from every tier meanwhile by a failed check); ``on_adopted`` is told
      them (the KV events), newest first. The work is spread over the scheduler steps
      (``step``: ``ADOPT_PER_STEP`` chunks a step, then the path's other slots
      ``ADOPT_PER_STEP`` times ``SLOTS_PER_CHUNK`` a step; ``adopting`` says some is left:
      vLLM keeps an idle engine stepping), each slot out of service until its turn, so that
      a path back with hundreds of thousands of chunks holds no step for long; a path out
      again drops the rest.

    A path back from a fault after it had been in service comes back empty: no rank finds
    anything on it.
    """

    def __init__(self, world_size: int, stack: TierStack, layout: SlotLayout,
                 on_adopted: Callable[[Adopted], None] | None = None) -> None:
        self.world_size, self._layout = world_size, layout
        self._index: SlotIndex = stack.indexes[TierName.DISK]
        self._adoption = PathAdoption(self._index)
        stack.on_discard = self._adoption.discarded
        self.on_adopted = on_adopted
        self._ranks_down = RankCount()  # disk path index -> ranks without it
        self._found: dict[tuple[int, int, ChunkKey], tuple[int, int]] = {}  # paths_found

    def apply(self, report: WorkerReport) -> None:
        if report.paths_down:
            self._found = without_paths(self._found, report.paths_down)
        for path, ranks in report.paths_down.items():
            self._adoption.path_out(path)  # (its slots kept out go out with the path)
            if self._ranks_down.up(path, ranks):
                self._index.retire(self._slots(path))
        if report.paths_found:
            self._found = found_added(self._found, report.paths_found)
        for path, ranks in report.paths_up.items():
            if self._ranks_down.down(path, ranks):
                self._back(path)

    @property
    def adopting(self) -> bool:
        return self._adoption.waiting

    def step(self) -> None:
        if self._adoption.waiting:
            adopted = self._adoption.step(ADOPT_PER_STEP)
            if adopted and self.on_adopted is not None:
                self.on_adopted(adopted)

    def _back(self, path: int) -> None:
        whole = sorted([(generation, slot, key) for (on, slot, key), (ranks, generation)
                        in self._found.items() if on == path and ranks >= self.world_size],
                       reverse=True)  # newest first
        self._found = without_paths(self._found, (path,))
        if whole:
            log.info("kvtier disk path %d back on every rank: %d chunks found on it by every "
                     "rank, adopted over the next steps", path, len(whole))
        self._adoption.start(path, self._slots(path), [(key, slot) for _, slot, key in whole])

    def _slots(self, path: int) -> range:
        return range(path, self._layout.num_slots, self._layout.num_paths)


def paths_back(world_size: int, stack: TierStack, layout: SlotLayout | None,
               feed: EventFeed | None) -> DiskPathsBack | None:
    """The disk paths of a scheduler side with a disk tier (``layout``), naming the chunks
    adopted to ``feed`` (the KV events) where there is one; None without a disk tier."""
    if layout is None:
        return None
    return DiskPathsBack(world_size, stack, layout, None if feed is None else feed.adopted)
