"""The disk paths as every rank sees them: a path's slots leave the scheduler side's index
when a first rank takes it out of service, and come back when every rank that did has it
back, with the chunks a path out since the start holds."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from kvtier.connector.common.messages import WorkerReport
from kvtier.connector.scheduler.event_feed import EventFeed
from kvtier.connector.scheduler.rank_counts import RankCount
from kvtier.keys import ChunkKey
from kvtier.segment.index_file import SlotLayout
from kvtier.tiers.base import TierName
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.stack import TierStack

log = logging.getLogger("kvtier")

Adopted = list[tuple[ChunkKey, int]]  # (key, disk slot)
ADOPT_PER_STEP = 4096  # chunks adopted per scheduler step at most: no step is held long


class DiskPathsBack:
    """Contract: ``apply(report)`` takes a worker report's disk paths, in this order:

    - out (``paths_down``): when a first rank takes a path out, its slots are retired (its
      chunks leave the index); what ranks found on it so far is forgotten;
    - found (``paths_found``): each rank's chunks on a path back after being out since the
      start (``kvtier.disk.retry.DiskRetries``) are gathered;
    - back (``paths_up``): once every rank that took a path out has it back, its slots come
      back into service and each chunk every rank (``world_size``) found in the same slot is
      adopted, to be evicted before every chunk held, oldest first, unless the index holds
      the key (a copy stored elsewhere meanwhile) or the slot; ``on_adopted`` is told them
      (the KV events), newest first. They are adopted ``ADOPT_PER_STEP`` a scheduler step
      (``step``; ``adopting`` says some are left: vLLM keeps an idle engine stepping),
      the newest first, their slots kept out of service until then (a path back with a
      hundred thousand chunks holds no step for long); a path out again drops the rest,
      and a key discarded from every tier meanwhile (a failed check) is not adopted.

    A path back from a fault after it had been in service comes back empty: no rank finds
    anything on it.
    """

    def __init__(self, world_size: int, stack: TierStack, layout: SlotLayout,
                 on_adopted: Callable[[Adopted], None] | None = None) -> None:
        self.world_size, self._layout = world_size, layout
        self._index: SlotIndex = stack.indexes[TierName.DISK]
        stack.on_discard = self._discarded
        self.on_adopted = on_adopted
        self._ranks_down = RankCount()  # disk path index -> ranks without it
        self._found: dict[int, dict[tuple[int, ChunkKey], tuple[int, int]]] = {}
        self._adopting: dict[int, deque[tuple[ChunkKey, int]]] = {}  # path -> newest first
        self._discards: set[ChunkKey] = set()  # discarded while some wait to be adopted

    def apply(self, report: WorkerReport) -> None:
        for path, ranks in report.paths_down.items():
            self._found.pop(path, None)
            self._adopting.pop(path, None)  # (its slots kept out go out with the path)
            if self._ranks_down.up(path, ranks):
                self._index.retire(self._slots(path))
        for (path, slot, key), (ranks, generation) in report.paths_found.items():
            found = self._found.setdefault(path, {})
            had = found.get((slot, key), (0, generation))
            found[(slot, key)] = (had[0] + ranks, min(had[1], generation))
        for path, ranks in report.paths_up.items():
            if self._ranks_down.down(path, ranks):
                self._back(path, self._found.pop(path, {}))

    @property
    def adopting(self) -> bool:
        return bool(self._adopting)

    def step(self) -> None:
        if self._adopting:
            self._adopt(ADOPT_PER_STEP)

    def _back(self, path: int, found: dict[tuple[int, ChunkKey], tuple[int, int]]) -> None:
        whole = sorted(((generation, slot, ChunkKey(key)) for (slot, key), (ranks, generation)
                        in found.items() if ranks >= self.world_size), reverse=True)
        kept = self._index.unretire(self._slots(path), but={slot for _, slot, _ in whole})
        if found:
            log.info("kvtier disk path %d back on every rank: %d chunks found on it by every "
                     "rank, adopted over the next steps", path, len(whole))
        if kept:  # newest first, each before the last
            if not self._adopting:  # discards told before are of no chunk waiting now
                self._discards.clear()
            self._adopting[path] = deque((key, slot) for _, slot, key in whole if slot in kept)

    def _adopt(self, budget: int) -> None:
        adopted: Adopted = []
        for path, pending in list(self._adopting.items()):
            taken = min(budget, len(pending))
            for _ in range(taken):
                key, slot = pending.popleft()
                if self._index.adopt_retired(key, slot, first=True):
                    if key not in self._discards:
                        adopted.append((key, slot))
                    else:  # its slot back in service, empty
                        self._index.discard(key)
            budget -= taken
            if not pending:
                del self._adopting[path]
            if budget <= 0:
                break
        if adopted and self.on_adopted is not None:
            self.on_adopted(adopted)

    def _discarded(self, key: ChunkKey) -> None:
        if self._adopting:
            self._discards.add(key)

    def _slots(self, path: int) -> range:
        return range(path, self._layout.num_slots, self._layout.num_paths)


def paths_back(world_size: int, stack: TierStack, layout: SlotLayout | None,
               feed: EventFeed | None) -> DiskPathsBack | None:
    """The disk paths of a scheduler side with a disk tier (``layout``), naming the chunks
    adopted to ``feed`` (the KV events) where there is one; None without a disk tier."""
    if layout is None:
        return None
    return DiskPathsBack(world_size, stack, layout, None if feed is None else feed.adopted)
