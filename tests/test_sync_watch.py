"""``SyncedIndex``: the chunks a flush's syncs did not cover are those committed on a path
after that path's sync began, as long as the flush watches; nothing else is noted."""

from kvtier.keys import ChunkKey
from kvtier.store.sync_watch import SyncedIndex
from kvtier.tiers.policy import LRUPolicy


def _key(n: int) -> ChunkKey:
    return ChunkKey(n.to_bytes(16, "big"))


def _committed(index: SyncedIndex, n: int) -> ChunkKey:
    key = _key(n)
    assert index.reserve(key) is not None and index.commit(key)
    return key


def test_only_commits_on_a_path_after_its_sync_began_are_late():
    index = SyncedIndex(8, LRUPolicy(), lambda slot: f"disk{slot % 2}")
    before = _committed(index, 0)  # no flush watching: nothing noted
    watch = index.watch()
    covered = _committed(index, 1)  # before any sync began
    watch.begin("disk0")
    late = [key for key in (_committed(index, n) for n in range(2, 6))
            if index.slot_of(key) % 2 == 0]
    assert late and watch.late == set(late) and not {before, covered} & watch.late
    index.unwatch(watch)
    _committed(index, 6)
    assert watch.late == set(late)


def test_a_chunk_adopted_on_a_path_after_its_sync_began_is_late_too():
    """(a path back after being out since the start: what it holds no sync of this flush
    covered)"""
    index = SyncedIndex(8, LRUPolicy(), lambda slot: f"disk{slot % 2}")
    watch = index.watch()
    assert index.adopt(_key(1), 1)  # before its path's sync began
    watch.begin("disk1")
    assert index.adopt(_key(3), 3) and index.adopt(_key(4), 4, first=True)
    assert not index.adopt(_key(3), 5)  # taken: nothing noted
    assert watch.late == {_key(3)}
