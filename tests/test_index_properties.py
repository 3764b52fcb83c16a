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
        self.retired: set[int] = set()

    @rule(key=KEYS)
    def reserve(self, key):
        result = self.index.reserve(key)
        present = key in self.writing or key in self.ready or key in self.doomed
        evictable = [k for k in self.ready if not self.pins.get(k)]
        free = SLOTS - len(self._held_slots() | self.retired)
        if present or (free == 0 and not evictable):
            assert result is None
            return
        assert result is not None
        if result.victim is not None:
            assert free == 0 and result.victim in evictable
            assert self.ready.pop(result.victim) == result.slot
        assert result.slot not in self._held_slots() | self.retired
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

    @rule(data=st.data())
    def retire(self, data):
        pinned = sorted(self.ready[k] for k in self.pins if k in self.ready)
        slot = data.draw(st.sampled_from(pinned) if pinned else st.integers(0, SLOTS - 1))
        if slot in self.writing.values():
            return  # the owners retire a failed disk's slots; writes to it fail and abort
        owner = [k for k, s in self.ready.items() if s == slot]
        assert self.index.retire(range(slot, slot + 1)) == owner
        for key in owner:
            self.ready.pop(key)
            if self.pins.get(key):
                self.doomed[key] = slot
        self.retired.add(slot)

    @precondition(lambda self: self.retired)
    @rule(data=st.data())
    def unretire(self, data):
        slot = data.draw(st.sampled_from(sorted(self.retired)))
        self.index.unretire(range(slot, slot + 1))
        self.retired.discard(slot)

    def _held_slots(self):
        return {*self.writing.values(), *self.ready.values(), *self.doomed.values()}

    @invariant()
    def agrees_with_the_model(self):
        assert sorted(self.index.keys()) == sorted(self.ready)
        assert len(self.index) == len(self.ready)
        assert all(self.index.slot_of(k) == s for k, s in self.ready.items())
        held = self._held_slots()
        assert len(held) == len(self.writing) + len(self.ready) + len(self.doomed)
        free = SLOTS - len(held | self.retired)
        assert self.index.free_slots == free
        unpinned = [k for k in self.ready if not self.pins.get(k)]
        assert self.index.reusable_slots == free + len(unpinned)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
