"""TierStack: prefix matching, placement, demotion and pins across tiers."""

from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierName
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.policy import LRUPolicy
from kvtier.tiers.stack import Location, Move, TierStack

GPU, HOST = TierName.GPU, TierName.HOST


def k(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def stack(gpu_slots=2, host_slots=3) -> TierStack:
    return TierStack([(GPU, SlotIndex(gpu_slots, LRUPolicy())),
                      (HOST, SlotIndex(host_slots, LRUPolicy()))])


def store(s: TierStack, key, tier=GPU):
    plan = s.plan_store(key, tier)
    for move in plan.demotions:
        s.finish(move.key, move.dst, True)
    s.finish(key, plan.dst, True)
    return plan


def test_empty_prefix_and_empty_stack():
    s = stack()
    assert s.match_prefix([]).num_chunks == 0
    assert s.match_prefix([k(1), k(2)]).num_chunks == 0


def test_prefix_stops_at_the_first_miss():
    s = stack()
    store(s, k(1))
    store(s, k(3))
    match = s.match_prefix([k(1), k(2), k(3)])
    assert match.num_chunks == 1 and match.locations[0].tier is GPU


def test_full_hit_across_tiers():
    s = stack()
    store(s, k(1), HOST)
    store(s, k(2), GPU)
    match = s.match_prefix([k(1), k(2)])
    assert [loc.tier for loc in match.locations] == [HOST, GPU]
    assert match.chunks_in(HOST) == 1 and match.chunks_in(GPU) == 1


def test_eviction_demotes_the_victim_one_tier_down():
    s = stack(gpu_slots=1)
    first = store(s, k(1))
    plan = s.plan_store(k(2), GPU)
    (move,) = plan.demotions
    assert move == Move(k(1), Location(GPU, first.dst.slot), move.dst) and move.dst.tier is HOST
    assert s.locate(k(1)) is None  # in flight: a miss, never stale bytes
    s.finish(move.key, move.dst, True)
    s.finish(k(2), plan.dst, True)
    assert s.locate(k(1)).tier is HOST and s.locate(k(2)).tier is GPU
    assert s.demotions == 1


def test_a_victim_already_below_is_not_copied_again():
    s = stack(gpu_slots=1)
    store(s, k(1), HOST)
    store(s, k(1), GPU)
    assert s.plan_store(k(2), GPU).demotions == ()
    assert s.locate(k(1)).tier is HOST


def test_victims_of_the_last_tier_are_dropped():
    s = stack(gpu_slots=1, host_slots=1)
    store(s, k(1))
    store(s, k(2))  # k1 -> host
    plan = store(s, k(3))  # k2 -> host evicts k1 (dropped)
    assert [m.key for m in plan.demotions] == [k(2)]
    assert s.locate(k(1)) is None and s.drops == 1


def test_cascade_runs_deepest_move_first():
    s = TierStack([(GPU, SlotIndex(1, LRUPolicy())), (HOST, SlotIndex(1, LRUPolicy())),
                   (TierName.DISK, SlotIndex(1, LRUPolicy()))])
    store(s, k(1))
    store(s, k(2))  # k1 -> host
    plan = s.plan_store(k(3), GPU)  # k2 -> host, which first moves k1 -> disk
    assert [(m.key, m.src.tier, m.dst.tier) for m in plan.demotions] == [
        (k(1), HOST, TierName.DISK), (k(2), GPU, HOST)]


def three_tiers(gpu_slots=1, host_slots=1, disk_slots=2) -> TierStack:
    return TierStack([(GPU, SlotIndex(gpu_slots, LRUPolicy())),
                      (HOST, SlotIndex(host_slots, LRUPolicy())),
                      (TierName.DISK, SlotIndex(disk_slots, LRUPolicy()))])


def test_a_victim_passes_over_a_tier_with_no_room_now():
    s = three_tiers()
    store(s, k(1), HOST)
    s.pin_prefix([k(1)], HOST)  # the only host slot, held (by its write to disk)
    store(s, k(2))
    plan = s.plan_store(k(3), GPU)
    assert [(m.key, m.src.tier, m.dst.tier) for m in plan.demotions] == [
        (k(2), GPU, TierName.DISK)]
    assert s.drops == 0 and s.demotions == 1


def test_a_victim_already_two_tiers_below_is_kept_there():
    s = three_tiers()
    store(s, k(1), HOST)
    s.pin_prefix([k(1)], HOST)
    store(s, k(2), TierName.DISK)
    store(s, k(2))
    assert s.plan_store(k(3), GPU).demotions == ()
    assert s.locate(k(2)).tier is TierName.DISK and s.drops == 0


def test_a_victim_with_no_room_anywhere_below_is_dropped():
    s = three_tiers(disk_slots=1)
    store(s, k(1), HOST)
    store(s, k(4), TierName.DISK)
    s.pin_prefix([k(1)], HOST)
    s.pin_prefix([k(4)], TierName.DISK)
    store(s, k(2))
    assert s.plan_store(k(3), GPU).demotions == ()
    assert s.locate(k(2)) is None and s.drops == 1


def test_failed_demotion_leaves_a_miss():
    s = stack(gpu_slots=1)
    store(s, k(1))
    plan = s.plan_store(k(2), GPU)
    s.finish(k(1), plan.demotions[0].dst, False)
    s.finish(k(2), plan.dst, True)
    assert s.locate(k(1)) is None and s.indexes[HOST].free_slots == 3


def test_pinned_prefix_survives_pressure():
    s = stack(gpu_slots=1, host_slots=1)
    store(s, k(1))
    ((key, location),) = s.pin_prefix([k(1)])
    assert s.plan_store(k(2), GPU) is None  # the only gpu slot is pinned
    assert s.pin_prefix([k(1)], HOST) == []  # not in that tier: nothing pinned
    s.unpin(key, location)
    assert s.plan_store(k(2), GPU) is not None


def test_discard_removes_every_copy():
    s = stack()
    store(s, k(1), HOST)
    store(s, k(1), GPU)
    assert s.discard(k(1)) == 2
    assert s.locate(k(1)) is None


def test_a_promotion_is_refused_where_its_victim_finds_room_below_only_in_the_gets_chunks():
    s = stack(gpu_slots=1, host_slots=2)
    for key in (k(1), k(2), k(3)):  # host: 1, 2; device pool: 3
        store(s, key)
    drops = s.drops
    assert s.plan_promotion(k(1), GPU, keep={k(1), k(2)}) is None  # 3 would be dropped
    assert s.drops == drops and s.locate(k(3)) == Location(GPU, s.indexes[GPU].slot_of(k(3)))
    plan = s.plan_promotion(k(1), GPU, keep={k(1)})  # 3 goes down over 2: eviction as usual
    assert plan is not None and [m.key for m in plan.demotions] == [k(3)]


def test_a_victim_with_a_copy_doomed_below_counts_as_finding_no_room_there():
    """A doomed copy (discarded while pinned) blocks a new entry for its key, so the victim
    would be dropped: the promotion is refused. Found by a review."""
    s = TierStack([(HOST, SlotIndex(1, LRUPolicy())), (TierName.DISK, SlotIndex(2, LRUPolicy()))])
    store(s, k(1), HOST)
    store(s, k(1), TierName.DISK)
    s.indexes[TierName.DISK].pin(k(1))
    s.indexes[TierName.DISK].discard(k(1))
    assert s.plan_promotion(k(9), HOST, keep={k(9)}) is None and s.drops == 0


def test_below_the_lowest_tier_in_service_a_victim_is_evicted_as_usual():
    """A disk index with no slot in service (none configured, or every path down) is no
    lower tier: the host victim of a promotion's demotion is evicted as usual. Found by a
    review: every promotion of a memory-only store was refused."""
    disk = SlotIndex(2, LRUPolicy())
    disk.retire(range(2))
    s = TierStack([(GPU, SlotIndex(1, LRUPolicy())), (HOST, SlotIndex(1, LRUPolicy())),
                   (TierName.DISK, disk)])
    store(s, k(1))
    store(s, k(2))  # host: 1; device pool: 2
    assert s.plan_promotion(k(1), GPU, keep={k(1)}) is None  # 2 could go only over 1
    store(s, k(3), HOST)  # host: 3 (1 evicted)
    assert s.plan_promotion(k(4), GPU, keep={k(4)}) is not None  # 2 goes down over 3
