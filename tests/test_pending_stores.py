"""The scheduler side's record of write-back demotions (``PendingStores``): a host slot a
victim leaves is known as left once that victim's disk write is over, whatever order the
writes end in, a key demoted from two slots leaves both, and a slot demoted again keeps its
newer victim."""

from kvtier.connector.scheduler.records import PendingStores
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import Location, Move


def key(n: int) -> ChunkKey:
    return ChunkKey(n.to_bytes(16, "big"))


def demotion(n: int, host_slot: int, disk_slot: int) -> Move:
    return Move(key(n), Location(TierName.HOST, host_slot), Location(TierName.DISK, disk_slot))


def test_each_demotion_leaves_its_slot_once_its_write_is_over():
    pending = PendingStores()
    writes = pending.demotion_writes(tuple(demotion(n, n, 100 + n) for n in range(1, 2001)))
    assert len(writes) == 2000 and len(pending.demoting) == 2000
    for n in range(2000, 0, -2):  # every other one, the last first
        pending.demoted(key(n))
    assert sorted(pending.demoting) == list(range(1, 2001, 2))
    assert all(pending.demoting[slot] == key(slot) for slot in pending.demoting)
    pending.demoted(key(9999))  # not a demotion: nothing changes
    assert len(pending.demoting) == 1000


def test_a_key_demoted_from_two_slots_leaves_both_and_a_slot_keeps_its_newer_victim():
    pending = PendingStores()
    pending.demotion_writes((demotion(1, 5, 50), demotion(1, 6, 60), demotion(2, 7, 70)))
    pending.demotion_writes((demotion(3, 7, 71),))  # slot 7 again: its newer victim
    pending.demoted(key(2))  # the older victim's write over: slot 7 still left by 3's
    assert pending.demoting == {5: key(1), 6: key(1), 7: key(3)}
    pending.demoted(key(1))
    assert pending.demoting == {7: key(3)}
    pending.demoted(key(3))
    assert pending.demoting == {}
