"""A disk path of a standalone ``KVStore`` back after being out since the start: what it
holds is adopted a share at each hold of the store's lock (``store/adoption.py``), newest
first, its slots out of service until then, so that a path with hundreds of thousands of
chunks holds no get or put for long; a key discarded or stored elsewhere meanwhile keeps
its state, and a path out again drops the rest."""

import time

from kvtier import KVStore
from kvtier.disk.recovery import RecoveredSlot
from kvtier.io.format import Codec, SlotHeader
from kvtier.keys import ChunkKey
from kvtier.store import adoption
from kvtier.store.adoption import Adoption
from kvtier.tiers.base import TierName
from kvtier.tiers.index import SlotIndex
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


def path_one_out(slots: int = 8) -> tuple[SlotIndex, range]:
    index = SlotIndex(slots, make_policy("lru"))
    path = range(1, slots, 2)  # the odd slots: path 1 of two
    index.retire(path)
    return index, path


def test_a_share_is_adopted_at_a_time_newest_first_the_rest_out_of_service():
    index, path = path_one_out()
    a, b, c, d = KEYS[:4]
    waiting = Adoption(index)
    assert waiting.start(1, path, found((a, 1, 10), (b, 3, 30), (c, 5, 50), (d, 7, 70)))
    assert len(index) == 0 and index.free_slots == 4  # the even slots only
    assert waiting.step(2) == 2 and waiting.waiting
    assert {index.slot_of(k) for k in (c, d)} == {5, 7} and index.free_slots == 4
    fill = [ChunkKey(bytes([20 + n]) * 16) for n in range(4)]
    for key in fill:  # every free slot taken: none of those kept for a and b
        reservation = index.reserve(key)
        assert reservation is not None and reservation.slot not in (1, 3) and index.commit(key)
    assert waiting.step(2) == 2 and not waiting.waiting
    victims = [index.reserve(ChunkKey(bytes([40 + n]) * 16)).victim for n in range(4)]
    assert victims == [a, b, c, d]  # oldest first, before what was stored meanwhile


def test_a_key_discarded_or_stored_elsewhere_meanwhile_is_not_adopted():
    index, path = path_one_out()
    a, b, c = KEYS[:3]
    assert index.adopt(b, 0)  # stored on path 0 while path 1 was out
    waiting = Adoption(index)
    waiting.start(1, path, found((a, 1, 10), (b, 3, 30), (c, 5, 50)))
    waiting.discarded(a)  # a failed check of another copy, or a delete
    assert waiting.step() == 1
    assert index.slot_of(c) == 5 and index.slot_of(b) == 0 and index.slot_of(a) is None
    assert index.free_slots == index.num_slots - 2  # slots 1 and 3 back in service, empty


def test_a_path_out_again_drops_its_chunks_waiting():
    index, path = path_one_out()
    waiting = Adoption(index)
    waiting.start(1, path, found((KEYS[0], 1, 10), (KEYS[1], 3, 30)))
    assert waiting.step(1) == 1
    waiting.path_out(1)
    index.retire(path)
    assert not waiting.waiting and waiting.step() == 0 and index.free_slots == 4
    assert not waiting.start(1, path, [])  # back empty: every slot in service, nothing waits
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
    real = Adoption.step
    monkeypatch.setattr(Adoption, "step", lambda self, budget=None: shares.append(
        real(self, budget)) or shares[-1])
    given = []
    start = Adoption.start
    monkeypatch.setattr(Adoption, "start", lambda self, path, slots, found: given.append(
        [r.header.generation for r in found]) or start(self, path, slots, found))
    with KVStore(SMALL, {**cfg, "disk_retry": 0.001}) as store:
        at_start = store.stats().recovered_chunks
        assert 0 < at_start < 12 and str(roots[1]) in store.stats().paths_down
        (tmp_path / "away").rename(roots[1])
        time.sleep(0.01)  # past disk_retry

        def adopted() -> bool:
            store.lookup(seq(90_000, 1))  # each call tries the paths due
            return store.stats().recovered_chunks == 12
        wait_until(adopted, "the path's chunks were never all adopted")
        assert shares == [3, 3] and not store.stats().paths_down
        assert given[-1] == sorted(given[-1], reverse=True)  # newest first, sorted off the lock
        assert exact(store, tokens) == 12 * CHUNK and store.stats().corruptions == 0
    assert TierName.DISK in store.stats().chunks_loaded
