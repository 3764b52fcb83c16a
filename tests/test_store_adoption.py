"""A disk path back after being out since the start (``tiers/path_adoption.py``, a
standalone ``KVStore``'s and the connector's scheduler side's): what it holds is adopted a
share at a time (a hold of the store's lock, a scheduler step), newest first, then its other
slots are put back in service a slice at a time, each slot out of service until then, so
that a path with hundreds of thousands of chunks holds no get, put or step for long; a key
discarded or stored elsewhere meanwhile keeps its state, and a path out again drops the
rest."""

import time

from kvtier import KVStore
from kvtier.disk.recovery import RecoveredSlot
from kvtier.io.format import Codec, SlotHeader
from kvtier.keys import ChunkKey
from kvtier.store import adoption
from kvtier.store.books import Held
from kvtier.tiers.base import TierName
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.path_adoption import SLOTS_PER_CHUNK, PathAdoption
from kvtier.tiers.policy import make_policy
from tests.helpers.disk_helpers import wait_until
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.store import config, exact, seq

KEYS = [ChunkKey(bytes([n]) * 16) for n in range(1, 9)]


def found(*chunks: tuple[ChunkKey, int, int]) -> list[RecoveredSlot]:
    """(key, slot, generation) of each chunk a path back holds, newest first (as a
    read-back's thread sorts them)."""
    return [RecoveredSlot(slot, SlotHeader(b"n" * 16, key, Codec.NONE, 0, 0, 0, generation, 0))
            for key, slot, generation in sorted(chunks, key=lambda c: c[2], reverse=True)]


def pairs(*chunks: tuple[ChunkKey, int, int]) -> list[tuple[ChunkKey, int]]:
    """(key, slot) of each chunk ``found`` names, newest first (``PathAdoption.start``'s)."""
    return [(r.header.key, r.slot) for r in found(*chunks)]


def keys(adopted: list[tuple[ChunkKey, int]]) -> list[ChunkKey]:
    return [key for key, _ in adopted]


def path_one_out(slots: int = 8) -> tuple[SlotIndex, range]:
    index = SlotIndex(slots, make_policy("lru"))
    path = range(1, slots, 2)  # the odd slots: path 1 of two
    index.retire(path)
    return index, path


def test_a_share_is_adopted_at_a_time_newest_first_the_rest_out_of_service():
    index, path = path_one_out()
    a, b, c, d = KEYS[:4]
    waiting = PathAdoption(index)
    waiting.start(1, path, pairs((a, 1, 10), (b, 3, 30), (c, 5, 50), (d, 7, 70)))
    assert len(index) == 0 and index.free_slots == 4  # the even slots only
    assert keys(waiting.step(2)) == [d, c] and waiting.waiting
    assert {index.slot_of(k) for k in (c, d)} == {5, 7} and index.free_slots == 4
    fill = [ChunkKey(bytes([20 + n]) * 16) for n in range(4)]
    for key in fill:  # every free slot taken: none of those kept for a and b
        reservation = index.reserve(key)
        assert reservation is not None and reservation.slot not in (1, 3) and index.commit(key)
    assert keys(waiting.step(2)) == [b, a]
    assert waiting.step(2) == [] and not waiting.waiting  # (the path's other slots: none)
    victims = [index.reserve(ChunkKey(bytes([40 + n]) * 16)).victim for n in range(4)]
    assert victims == [a, b, c, d]  # oldest first, before what was stored meanwhile


def test_the_paths_other_slots_come_back_a_slice_a_step_once_every_chunk_is_adopted():
    """A path's slots no chunk was found in stay out of service until every chunk found is
    adopted, then come back ``SLOTS_PER_CHUNK`` for each chunk of a step's budget."""
    slots = 2 + 2 * 2 * SLOTS_PER_CHUNK * 3  # the path's 49: four slices of 16
    index, path = path_one_out(slots)
    a, b = KEYS[:2]
    waiting = PathAdoption(index)
    waiting.start(1, path, pairs((a, 1, 10), (b, 3, 30)))
    assert keys(waiting.step(2)) == [b, a] and index.free_slots == slots // 2
    back = [index.free_slots]
    while waiting.waiting:
        assert waiting.step(2) == []
        back.append(index.free_slots)
    per_step, odd = 2 * SLOTS_PER_CHUNK, slots // 2  # the path's: 1 and 3 among the first
    assert back == [odd, odd + per_step - 2, odd + 2 * per_step - 2, odd + 3 * per_step - 2,
                    slots - 2]
    assert index.in_service == slots


def test_a_chunk_named_on_another_paths_slot_or_a_held_slot_is_not_adopted():
    """A slot outside the path (a report that lies, or a bug) is left as it is: the other
    path stays out; a slot an entry still holds (a read pinned it before the path went out)
    is not adopted, and comes back in service free once let go."""
    index = SlotIndex(8, make_policy("lru"))
    held = ChunkKey(b"h" * 16)
    assert index.adopt(held, 3) and index.pin(held) == 3
    index.retire(range(0, 8, 2))  # path 0, out
    index.retire(range(1, 8, 2))  # path 1, out: the pinned chunk goes, its slot held
    waiting = PathAdoption(index)
    a, b, c = KEYS[:3]
    waiting.start(1, range(1, 8, 2), pairs((a, 2, 10), (b, 3, 20), (c, 5, 30)))
    assert keys(waiting.step(8)) == [c] and not waiting.waiting
    assert index.slot_of(a) is None and index.slot_of(b) is None
    assert index.in_service == 4 and index.free_slots == 2  # slots 1 and 7 (3: held)
    index.unpin(held)
    assert index.free_slots == 3 and all(index.reserve(ChunkKey(bytes([50 + n]) * 16)).slot
                                         % 2 == 1 for n in range(3))


def test_a_key_discarded_or_stored_elsewhere_meanwhile_is_not_adopted():
    index, path = path_one_out()
    a, b, c = KEYS[:3]
    assert index.adopt(b, 0)  # stored on path 0 while path 1 was out
    waiting = PathAdoption(index)
    waiting.start(1, path, pairs((a, 1, 10), (b, 3, 30), (c, 5, 50)))
    waiting.discarded(a)  # a failed check of another copy, or a delete
    assert keys(waiting.step(8)) == [c]
    assert index.slot_of(c) == 5 and index.slot_of(b) == 0 and index.slot_of(a) is None
    assert index.free_slots == index.num_slots - 2  # slots 1 and 3 back in service, empty


def test_a_path_out_again_drops_its_chunks_waiting():
    index, path = path_one_out()
    waiting = PathAdoption(index)
    waiting.start(1, path, pairs((KEYS[0], 1, 10), (KEYS[1], 3, 30)))
    assert len(waiting.step(1)) == 1
    waiting.path_out(1)
    index.retire(path)
    assert not waiting.waiting and waiting.step(8) == [] and index.free_slots == 4
    waiting.start(1, path, [])  # back empty: every slot in service once stepped
    assert waiting.step(8) == [] and not waiting.waiting
    assert index.free_slots == 8 and len(index) == 0  # the one adopted went out with its path


def test_a_store_adopts_a_path_back_a_share_per_lock_hold(tmp_path, monkeypatch):
    """Six chunks on a path missing at start, three a hold: two holds, each a call of its
    own; every byte served from them once back."""
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        root.mkdir()
    cfg = {**config(tmp_path, host_chunks=2), "disk_paths": [str(r) for r in roots]}
    tokens = seq(0, 12)
    with KVStore(SMALL, cfg) as first:
        first.put(tokens, make_kv(tokens))
        assert first.flush()
    roots[1].rename(tmp_path / "away")
    monkeypatch.setattr(adoption, "ADOPT_PER_HOLD", 3)
    shares = []
    real = PathAdoption.step

    def step(self, budget):
        adopted = real(self, budget)
        shares.append(len(adopted))
        return adopted
    monkeypatch.setattr(PathAdoption, "step", step)
    given = []
    back = Held.path_back
    monkeypatch.setattr(Held, "path_back", lambda self, index, found=(): given.append(
        [r.header.generation for r in found]) or back(self, index, found))
    with KVStore(SMALL, {**cfg, "disk_retry": 0.001}) as store:
        at_start = store.stats().recovered_chunks
        assert 0 < at_start < 12 and str(roots[1]) in store.stats().paths_down
        (tmp_path / "away").rename(roots[1])
        time.sleep(0.01)  # past disk_retry

        def adopted() -> bool:
            store.lookup(seq(90_000, 1))  # each call tries the paths due
            return store.stats().recovered_chunks == 12
        wait_until(adopted, "the path's chunks were never all adopted")
        assert shares[:2] == [3, 3] and not any(shares[2:]) and not store.stats().paths_down
        assert given[-1] == sorted(given[-1], reverse=True)  # newest first, sorted off the lock
        assert exact(store, tokens) == 12 * CHUNK and store.stats().corruptions == 0
    assert TierName.DISK in store.stats().chunks_loaded
