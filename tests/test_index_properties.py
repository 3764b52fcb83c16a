"""SlotIndex against a simple model, over random operation sequences (hypothesis)."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.keys import ChunkKey
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.policy import make_policy

SLOTS = 4
KEYS = st.integers(0, 9).map(lambda i: ChunkKey(i.to_bytes(16, "little")))


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = SlotIndex(SLOTS, make_policy("lru"))
        self.writing: dict[ChunkKey, int] = {}
        self.ready: dict[ChunkKey, int] = {}  # key -> slot
        self.pins: dict[ChunkKey, int] = {}  # visible or doomed key -> pin count
        self.doomed: dict[ChunkKey, int] = {}  # key -> slot held by readers

    @rule(key=KEYS)
    def reserve(self, key):
        result = self.index.reserve(key)
        present = key in self.writing or key in self.ready or key in self.doomed
        evictable = [k for k in self.ready if not self.pins.get(k)]
        used = len(self.writing) + len(self.ready) + len(self.doomed)
        if present or (used == SLOTS and not evictable):
            assert result is None
            return
        assert result is not None
        if result.victim is not None:
            assert used == SLOTS and result.victim in evictable
            assert self.ready.pop(result.victim) == result.slot
        assert result.slot not in self._held_slots()
        self.writing[key] = result.slot

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), ok=st.booleans())
    def finish(self, data, ok):
        key = data.draw(st.sampled_from(sorted(self.writing)))
        slot = self.writing.pop(key)
        if ok:
            self.index.commit(key)
            self.ready[key] = slot
        else:
            self.index.abort(key)

    @rule(key=KEYS)
    def pin(self, key):
        slot = self.index.pin(key)
        assert slot == self.ready.get(key)
        if slot is not None:
            self.pins[key] = self.pins.get(key, 0) + 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(self.pins)))
        self.index.unpin(key)
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]
            self.doomed.pop(key, None)

    @rule(key=KEYS)
    def discard(self, key):
        assert self.index.discard(key) == (key in self.ready)
        if key in self.ready:
            slot = self.ready.pop(key)
            if self.pins.get(key):
                self.doomed[key] = slot

    @rule(key=KEYS)
    def touch(self, key):
        self.index.touch(key)

    def _held_slots(self):
        return {*self.writing.values(), *self.ready.values(), *self.doomed.values()}

    @invariant()
    def agrees_with_the_model(self):
        assert sorted(self.index.keys()) == sorted(self.ready)
        assert len(self.index) == len(self.ready)
        assert all(self.index.slot_of(k) == s for k, s in self.ready.items())
        held = self._held_slots()
        assert len(held) == len(self.writing) + len(self.ready) + len(self.doomed)
        assert self.index.free_slots == SLOTS - len(held)
        unpinned = [k for k in self.ready if not self.pins.get(k)]
        assert self.index.reusable_slots == SLOTS - len(held) + len(unpinned)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
