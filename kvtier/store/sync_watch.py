"""What a flush's syncs cover: ``SyncedIndex``, a store's disk index that tells each flush
under way which chunks were committed on a disk path after that path's sync began. No sync
covered those (their slots and index entries may have been written after the files were
synced: a power loss may lose them), so the flush counts them as not on disk."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.keys import ChunkKey
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.policy import EvictionPolicy


class SyncWatch:
    """One flush's watch (the store's lock held throughout): the queues (one per disk path)
    whose sync has begun (``begin``, called just before that sync), and the chunks committed
    since on a slot of one of them (``late``)."""

    def __init__(self) -> None:
        self.begun: set[str] = set()
        self.late: set[ChunkKey] = set()

    def begin(self, queue: str) -> None:
        self.begun.add(queue)


class SyncedIndex(SlotIndex):
    """The disk tier's ``SlotIndex`` of a ``KVStore``, with its flushes' watches.

    Contract (the store's lock held, as for every ``SlotIndex`` call): ``watch()`` starts a
    ``SyncWatch`` for one flush, ``unwatch(watch)`` ends it. Once ``watch.begin(queue)``
    said that the flush's sync of the disk path of ``queue`` begins (``queue_of(slot)``
    names each slot's), and until ``unwatch``, each key that ``commit`` (or ``adopt``) makes
    visible on a slot of that queue joins ``watch.late``. A key committed before is covered by the
    sync: its slot and index entry were written before the commit. Nothing is noted while
    no flush watches, so what a watch holds is bounded by the writes over during one flush.
    """

    def __init__(self, num_slots: int, policy: EvictionPolicy[ChunkKey],
                 queue_of: Callable[[int], str]) -> None:
        super().__init__(num_slots, policy)
        self._queue_of = queue_of
        self._watches: list[SyncWatch] = []

    def watch(self) -> SyncWatch:
        watch = SyncWatch()
        self._watches.append(watch)
        return watch

    def unwatch(self, watch: SyncWatch) -> None:
        self._watches.remove(watch)

    def commit(self, key: ChunkKey) -> bool:
        if not super().commit(key):
            return False
        slot = self.slot_of(key)
        assert slot is not None, "a key just committed is visible"
        self._note(key, slot)
        return True

    def adopt(self, key: ChunkKey, slot: int, first: bool = False) -> bool:
        """(a path back read back: no sync of this flush covered what it found)"""
        if not super().adopt(key, slot, first):
            return False
        self._note(key, slot)
        return True

    def _note(self, key: ChunkKey, slot: int) -> None:
        queue = self._queue_of(slot) if self._watches else ""
        for watch in self._watches:
            if queue in watch.begun:
                watch.late.add(key)
