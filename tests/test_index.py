"""The SlotIndex contract (two-phase stores, pins, eviction), for every policy."""

import pytest

from kvtier.config.settings import EvictionPolicyName
from kvtier.keys import ChunkKey
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.policy import make_policy


def k(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


@pytest.fixture(params=list(EvictionPolicyName))
def make_index(request):
    return lambda slots: SlotIndex(slots, make_policy(request.param))


def fill(index, keys):
    for key in keys:
        index.reserve(key)
        index.commit(key)


def test_reserved_keys_are_invisible_until_commit(make_index):
    index = make_index(2)
    reservation = index.reserve(k(1))
    assert reservation.key == k(1) and reservation.victim is None
    assert k(1) not in index and index.pin(k(1)) is None and len(index) == 0
    assert index.has_entry(k(1))
    index.commit(k(1))
    assert k(1) in index and index.slot_of(k(1)) == reservation.slot and len(index) == 1


def test_abort_frees_the_slot(make_index):
    index = make_index(1)
    index.reserve(k(1))
    assert index.free_slots == 0
    index.abort(k(1))
    assert index.free_slots == 1 and not index.has_entry(k(1))
    assert index.reserve(k(2)) is not None


def test_reserving_a_present_key_returns_none(make_index):
    index = make_index(4)
    index.reserve(k(1))
    assert index.reserve(k(1)) is None  # being written
    index.commit(k(1))
    assert index.reserve(k(1)) is None  # visible


def test_slots_are_distinct(make_index):
    index = make_index(8)
    slots = {index.reserve(k(i)).slot for i in range(8)}
    assert slots == set(range(8))


def test_full_index_evicts_a_visible_unpinned_key(make_index):
    index = make_index(2)
    fill(index, [k(1), k(2)])
    reservation = index.reserve(k(3))
    assert reservation.victim == k(1)  # first in, never touched: LRU and FIFO agree
    assert reservation.slot not in (index.slot_of(k(2)),)
    assert k(1) not in index and index.evictions == 1


def test_peek_says_what_a_reserve_would_do_and_changes_nothing(make_index):
    index = make_index(3)
    fill(index, [k(1), k(2)])
    assert index.peek() == (True, None)
    fill(index, [k(3)])
    index.pin(k(2))
    assert index.peek() == (False, k(1)) and index.peek(keep={k(1)}) == (False, k(3))
    assert index.peek(keep={k(1), k(3)}) == (False, None)
    assert len(index) == 3 and index.evictions == 0
    assert index.reserve(k(4), keep={k(1)}).victim == k(3)


def test_a_write_that_ends_after_its_slot_was_retired_commits_nothing(make_index):
    """A write that ends after its path went down: its key is not made visible on the
    retired slot (it was, then fell out unseen at a later reserve: a review found such a
    chunk published on disk and never removed), and the slot stays out of service."""
    index = make_index(2)
    first = index.reserve(k(1))
    index.retire(range(first.slot, first.slot + 1))
    assert index.commit(k(1)) is False
    assert k(1) not in index and index.free_slots == 1
    fill(index, [k(2)])
    assert index.peek() == (False, k(2)) and index.reserve(k(3)).victim == k(2)
    assert index.peek(key=k(3)) == (False, None)  # a key with an entry: no reservation
    assert index.reserve(k(4)) is None  # the retired slot is not handed out


def test_pinned_keys_are_never_evicted(make_index):
    index = make_index(2)
    fill(index, [k(1), k(2)])
    index.pin(k(1))
    assert index.reserve(k(3)).victim == k(2)
    assert index.reserve(k(4)) is None  # k1 pinned, k3 being written: no room
    index.unpin(k(1))
    assert index.reserve(k(4)).victim == k(1)


def test_pins_count(make_index):
    index = make_index(1)
    fill(index, [k(1)])
    index.pin(k(1))
    index.pin(k(1))
    index.unpin(k(1))
    assert index.reserve(k(2)) is None
    index.unpin(k(1))
    assert index.reserve(k(2)).victim == k(1)


def test_keys_being_written_are_never_evicted(make_index):
    index = make_index(1)
    index.reserve(k(1))
    assert index.reserve(k(2)) is None


def test_discard_frees_an_unpinned_key(make_index):
    index = make_index(1)
    fill(index, [k(1)])
    assert index.discard(k(1))
    assert k(1) not in index and index.free_slots == 1
    assert not index.discard(k(1))


def test_discard_of_a_pinned_key_frees_it_at_last_unpin(make_index):
    index = make_index(1)
    fill(index, [k(1)])
    index.pin(k(1))
    assert index.discard(k(1))
    assert k(1) not in index and index.pin(k(1)) is None and len(index) == 0
    assert index.reserve(k(2)) is None  # slot still held by the reader
    index.unpin(k(1))
    assert index.free_slots == 1
    assert index.reserve(k(2)).victim is None


def test_adopt_records_recovered_keys(make_index):
    index = make_index(3)
    assert index.adopt(k(1), 2)
    assert not index.adopt(k(2), 2)  # slot taken
    assert not index.adopt(k(1), 0)  # key taken
    assert not index.adopt(k(3), 3)  # out of range
    assert index.slot_of(k(1)) == 2
    slots = {index.reserve(k(i)).slot for i in (4, 5)}
    assert slots == {0, 1}
    assert index.reserve(k(6)).victim == k(1)


def test_zero_slots_never_hold_anything(make_index):
    index = make_index(0)
    assert index.reserve(k(1)) is None


def test_misuse_is_caught():
    index = SlotIndex(2, make_policy("lru"))
    index.reserve(k(1))
    index.commit(k(1))
    with pytest.raises(AssertionError):
        index.commit(k(1))
    with pytest.raises(AssertionError):
        index.unpin(k(1))
    with pytest.raises(ValueError):
        SlotIndex(-1, make_policy("lru"))


def test_lru_keeps_recently_touched_keys():
    index = SlotIndex(2, make_policy("lru"))
    fill(index, [k(1), k(2)])
    index.touch(k(1))
    assert index.reserve(k(3)).victim == k(2)


def test_a_pin_counts_as_an_access_for_lru():
    index = SlotIndex(2, make_policy("lru"))
    fill(index, [k(1), k(2)])
    index.pin(k(1))
    index.unpin(k(1))
    assert index.reserve(k(3)).victim == k(2)


def test_a_pin_keeps_fifo_order():
    index = SlotIndex(2, make_policy("fifo"))
    fill(index, [k(1), k(2)])
    index.pin(k(1))
    index.unpin(k(1))
    assert index.reserve(k(3)).victim == k(1)


def test_a_path_going_out_and_back_again_and_again_keeps_the_free_list_bounded(make_index):
    index = make_index(64)
    fill(index, [k(i) for i in range(40)])
    for i in range(20):
        index.discard(k(i))
    for _ in range(50):  # a disk path out of service and back, over and over
        index.retire(range(64))  # what it held is gone with it
        index.unretire(range(64))
    assert index.free_slots == 64 and len(index._free) <= 64
    fill(index, [k(100 + i) for i in range(64)])  # every free slot handed out, once each
    assert sorted(index.slot_of(k(100 + i)) for i in range(64)) == list(range(64))
    assert index.free_slots == 0


def test_a_hold_keeps_a_discarded_key_s_slot_until_let_go(make_index):
    """An I/O still running on a slot holds it, even after its key was discarded: the slot
    is handed out again only once the hold is let go of."""
    index = make_index(1)
    index.reserve(k(1))
    index.commit(k(1))
    assert index.hold(k(1)) and not index.hold(k(9))
    assert index.discard(k(1)) and k(1) not in index
    assert index.reserve(k(2)) is None  # the only slot is still held
    index.unpin(k(1))
    assert index.reserve(k(2)) is not None
    census = index.census()
    assert census.pins == 0 and census.doomed == 0


def test_a_retired_slot_is_adopted_back_one_at_a_time_the_rest_unretired_after(make_index):
    """A path back with chunks to adopt over several steps: each slot adopted back
    (``adopt_retired``) comes back in service with its chunk, or free when the key is held
    elsewhere; a slot still held by a reader is not adopted, and the rest stay out of
    service (a store meanwhile never lands on one) until ``unretire`` puts them back."""
    index = make_index(6)
    held = index.reserve(k(9))
    assert held is not None and index.commit(k(9)) and index.pin(k(9)) == held.slot
    index.retire(range(6))
    assert not index.adopt_retired(k(3), held.slot)  # held: left as it is
    slot, other = sorted({0, 1, 2} - {held.slot})[:2]
    assert index.adopt_retired(k(1), slot, first=True) and index.slot_of(k(1)) == slot
    assert not index.adopt_retired(k(1), other)  # the key is held: the slot goes back free
    assert index.free_slots == 1 and index.reserve(k(30)).slot == other
    index.unretire(range(6))
    assert index.free_slots == 6 - 3 and index.in_service == 6  # (the held slot: at unpin)
    index.unpin(k(9))
    assert index.free_slots == 6 - 2
    assert not index.adopt_retired(k(2), slot)  # not retired (any more)
