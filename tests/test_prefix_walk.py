"""The one prefix walk (kvtier/tiers/prefix.py): where each chunk of a prefix is."""

from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierName
from kvtier.tiers.prefix import IN_REMOTE, InOther, Ours, find, walk_cached, walk_remote
from kvtier.tiers.stack import Location

KEYS = [ChunkKey(bytes([i]) * 32) for i in range(6)]
OURS = {KEYS[0]: Location(TierName.HOST, 3), KEYS[2]: Location(TierName.DISK, 7)}
THEIRS = {KEYS[1]: "writer-b slot 9", KEYS[2]: "writer-b slot 4", KEYS[4]: "writer-c slot 1"}


def test_our_copy_comes_before_another_writers():
    assert find(KEYS[2], OURS.get, THEIRS.get) == Ours(Location(TierName.DISK, 7))
    assert find(KEYS[1], OURS.get, THEIRS.get) == InOther("writer-b slot 9")
    assert find(KEYS[1], OURS.get, None) is None
    assert find(KEYS[3], OURS.get, THEIRS.get) is None


def test_the_walk_ends_at_the_first_chunk_held_nowhere():
    found = walk_cached(KEYS, OURS.get, THEIRS.get)
    assert found == [Ours(OURS[KEYS[0]]), InOther(THEIRS[KEYS[1]]), Ours(OURS[KEYS[2]])]
    assert [f.tier for f in found] == [TierName.HOST, TierName.SHARED, TierName.DISK]
    assert walk_cached(KEYS[3:], OURS.get, THEIRS.get) == []


def test_the_remote_store_adds_its_leading_run_without_a_local_view():
    asked: list[list[ChunkKey]] = []

    def held(tail):
        asked.append(list(tail))
        return [True, True, False, True][:len(tail)]

    assert walk_remote(KEYS[3:], held) == [IN_REMOTE, IN_REMOTE]
    assert asked == [KEYS[3:]]  # one question for the whole tail
    assert walk_remote([], held) == [] and len(asked) == 1  # no tail: nothing asked
    assert walk_remote(KEYS[3:], None) == []  # no remote store
    assert walk_remote(KEYS[3:], lambda tail: None) is None  # not answered yet
    assert IN_REMOTE.tier is TierName.REMOTE


def test_past_a_chunk_only_the_store_holds_chunks_cached_here_carry_the_walk_on():
    """A chunk cached here is taken from here whether the store holds it or not; the walk
    ends at the first chunk held by neither."""
    here = {KEYS[3]: Ours(Location(TierName.HOST, 1)), KEYS[5]: InOther("writer-b slot 2")}
    assert walk_remote(KEYS[2:], lambda tail: [True, False, True, False], here.get) == [
        IN_REMOTE, Ours(Location(TierName.HOST, 1)), IN_REMOTE, InOther("writer-b slot 2")]
    assert walk_remote(KEYS[2:], lambda tail: [True, True, False, False], here.get) == [
        IN_REMOTE, Ours(Location(TierName.HOST, 1))]  # KEYS[4]: neither
    assert walk_remote(KEYS[2:], lambda tail: [True], here.get) == [  # a short answer
        IN_REMOTE, Ours(Location(TierName.HOST, 1))]
