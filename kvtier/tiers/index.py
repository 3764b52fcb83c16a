"""Bookkeeping for one tier: which chunk is in which slot. Never touches bytes."""

from __future__ import annotations

from collections.abc import Collection

from kvtier.keys import ChunkKey
from kvtier.tiers.policy import EvictionPolicy
from kvtier.tiers.slot_entries import EntryState, IndexCensus, Reservation, SlotEntry

__all__ = ["EntryState", "IndexCensus", "Reservation", "SlotIndex"]


class SlotIndex:
    """Two-phase bookkeeping of ``num_slots`` fixed-size slots.

    Contract (checked by ``tests/test_index.py`` for every policy):

    - ``reserve(key, spare)`` returns a :class:`Reservation` on a free slot, or on the slot
      of the policy's victim (outside ``spare`` while it has one there); ``None`` when the
      key is already present in any state, or when every slot is pinned or being written
      ("no room"). A reserved key is invisible. ``peek(keep)`` says what a ``reserve`` with
      ``keep`` would do, changing no entry: a free slot, the victim it would evict, or none
      (each pinned key either passes goes to the end of the policy's order: ``victim``).
    - ``commit(key)`` makes a reserved key visible (False, and aborted, when its slot was
      retired meanwhile: no visible key ever lies on a retired slot); ``abort(key)`` frees
      its slot.
    - ``pin(key)`` returns the slot of a visible key and keeps it from eviction until the
      matching ``unpin``; pins count. ``None`` when the key is not visible. ``hold(key)``
      pins a visible or discarded-while-pinned key without touching it (an I/O still
      running on its slot).
    - ``discard(key)`` drops a visible key at once (corrupt or stale); a pinned one becomes
      invisible now and its slot is freed at its last ``unpin``.
    - ``adopt(key, slot)`` records a key found already in a slot (recovery after restart).
    - ``retire(slots)`` takes slots out of service (a failed disk): their visible keys are
      discarded, and none of them is handed out again until ``unretire(slots)`` puts them
      back, empty (the disk came back).
    - Only visible, unpinned keys are ever evicted. Not thread-safe: the owner locks.
    """

    def __init__(self, num_slots: int, policy: EvictionPolicy[ChunkKey]) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must not be negative, got {num_slots}")
        self.num_slots = num_slots
        self._policy = policy
        self._entries: dict[ChunkKey, SlotEntry] = {}
        self._free: list[int] = []  # slots given back (may hold adopted ones since)
        self._listed = bytearray(num_slots)  # in ``_free``: a slot is listed at most once
        self._fresh = 0  # slots from here on were never handed out (may be adopted since)
        self._is_free = bytearray(b"\x01") * num_slots
        self._key_at: list[ChunkKey | None] = [None] * num_slots  # the entry holding a slot
        self._retired = bytearray(num_slots)
        self._num_retired = 0
        self._num_free = num_slots
        self._num_visible = 0
        self._num_pinned = 0  # visible keys with at least one pin
        self.evictions = 0

    def __len__(self) -> int:
        """Number of visible keys."""
        return self._num_visible

    def __contains__(self, key: object) -> bool:
        entry = self._entries.get(key)  # type: ignore[call-overload]  # typeshed: get() takes only the key type
        return entry is not None and entry.state is EntryState.READY

    @property
    def free_slots(self) -> int:
        return self._num_free

    @property
    def reusable_slots(self) -> int:
        """Slots a ``reserve`` could get now: free ones and those of unpinned visible keys."""
        return self._num_free + self._num_visible - self._num_pinned

    def keys(self) -> list[ChunkKey]:
        """Visible keys, in no particular order."""
        return [k for k, _ in self.visible()]

    def visible(self) -> list[tuple[ChunkKey, int]]:
        """(key, slot) of each visible key, in no particular order: one pass."""
        ready = EntryState.READY
        return [(k, e.slot) for k, e in self._entries.items() if e.state is ready]

    def slot_of(self, key: ChunkKey) -> int | None:
        """Slot of a visible key, without touching or pinning it."""
        entry = self._entries.get(key)
        return entry.slot if entry is not None and entry.state is EntryState.READY else None

    def pinned(self, key: ChunkKey) -> bool:
        """True when ``key`` is visible and pinned."""
        entry = self._entries.get(key)
        return entry is not None and entry.state is EntryState.READY and entry.pins > 0

    def census(self) -> IndexCensus:
        """Entries by state and pins held (for checks of the bookkeeping and inspection)."""
        states = [entry.state for entry in self._entries.values()]
        return IndexCensus(len(states), states.count(EntryState.READY),
                           states.count(EntryState.WRITING), states.count(EntryState.DOOMED),
                           sum(entry.pins for entry in self._entries.values()))

    def has_entry(self, key: ChunkKey) -> bool:
        """True when the key is visible or being written."""
        entry = self._entries.get(key)
        return entry is not None and entry.state is not EntryState.DOOMED

    def reserve(self, key: ChunkKey, spare: Collection[ChunkKey] = (),
                keep: Collection[ChunkKey] = ()) -> Reservation | None:
        if key in self._entries:
            return None
        victim: ChunkKey | None = None
        slot = self._take_free() if self._num_free else None
        if slot is None and self.reusable_slots == 0:
            return None  # every key pinned: none to scan them all for
        if slot is None:  # a victim outside ``spare`` (a read's next chunks) while one is,
            # never one of ``keep`` (those a promotion must not cost)
            victim = self._policy.victim(lambda k: not self.pinned(k) and k not in spare
                                         and k not in keep, self.pinned) if spare or keep else None
            if victim is None and not keep:
                victim = self._policy.victim(lambda k: not self.pinned(k), self.pinned)
            if victim is None:
                return None
            self._policy.remove(victim)
            slot = self._entries.pop(victim).slot
            self._num_visible -= 1
            self.evictions += 1
        self._entries[key] = SlotEntry(slot, EntryState.WRITING)
        self._key_at[slot] = key
        return Reservation(key, slot, victim)

    def peek(self, keep: Collection[ChunkKey] = (),
             key: ChunkKey | None = None) -> tuple[bool, ChunkKey | None]:
        """What ``reserve(key, keep=keep)`` would do: ``(True, None)``, a free slot;
        ``(False, victim)``; ``(False, None)``, none (``key`` has an entry, or no room)."""
        if key is not None and key in self._entries:
            return False, None
        if self._num_free or not self.reusable_slots:
            return bool(self._num_free), None
        return False, self._policy.victim(lambda k: not self.pinned(k) and k not in keep,
                                          self.pinned)

    @property
    def in_service(self) -> int:
        """Slots not retired (a disk path down retires its slots)."""
        return self.num_slots - self._num_retired

    def commit(self, key: ChunkKey) -> bool:
        """Make a reservation visible; False, and it is aborted, when its slot was retired
        while it was written (the chunk is on a path out of service)."""
        entry = self._entries[key]
        assert entry.state is EntryState.WRITING, f"commit of a key in state {entry.state}"
        if self._retired[entry.slot]:
            self.abort(key)
            return False
        entry.state = EntryState.READY
        self._num_visible += 1
        self._policy.insert(key)
        return True

    def abort(self, key: ChunkKey) -> None:
        entry = self._entries.pop(key)
        assert entry.state is EntryState.WRITING, f"abort of a key in state {entry.state}"
        self._release(entry.slot)

    def adopt(self, key: ChunkKey, slot: int, first: bool = False) -> bool:
        """Record ``key`` as visible in ``slot`` (with ``first``, evicted before every key
        held: ``EvictionPolicy.insert``); False if the key or the slot is taken."""
        if key in self._entries or not 0 <= slot < self.num_slots or not self._is_free[slot]:
            return False
        self._is_free[slot] = 0
        self._num_free -= 1
        self._entries[key] = SlotEntry(slot, EntryState.READY)
        self._key_at[slot] = key
        self._num_visible += 1
        self._policy.insert(key, first)
        return True

    def pin(self, key: ChunkKey) -> int | None:
        entry = self._entries.get(key)
        if entry is None or entry.state is not EntryState.READY:
            return None
        entry.pins += 1
        self._num_pinned += entry.pins == 1
        self._policy.touch(key)
        return entry.slot

    def hold(self, key: ChunkKey) -> bool:
        """One more pin on ``key``'s entry, visible or discarded while pinned, without
        touching it: an I/O still running on its slot keeps the slot from being handed out
        again. False when it has no such entry. Let go with ``unpin``."""
        entry = self._entries.get(key)
        if entry is None or entry.state is EntryState.WRITING:
            return False
        entry.pins += 1
        self._num_pinned += entry.state is EntryState.READY and entry.pins == 1
        return True

    def unpin(self, key: ChunkKey) -> None:
        entry = self._entries[key]
        assert entry.pins > 0, "unpin without a pin"
        entry.pins -= 1
        if entry.pins == 0 and entry.state is EntryState.DOOMED:
            del self._entries[key]
            self._release(entry.slot)
        elif entry.pins == 0:
            self._num_pinned -= 1

    def touch(self, key: ChunkKey) -> None:
        """Record an access to a visible key (it counts as recent for the policy)."""
        if self.slot_of(key) is not None:
            self._policy.touch(key)

    def discard(self, key: ChunkKey) -> bool:
        """Drop a visible key; True if it was visible."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not EntryState.READY:
            return False
        self._num_visible -= 1
        self._policy.remove(key)
        if entry.pins:
            entry.state = EntryState.DOOMED
            self._num_pinned -= 1
            return True
        del self._entries[key]
        self._release(entry.slot)
        return True

    def retire(self, slots: range) -> list[ChunkKey]:
        """Take ``slots`` out of service; return the visible keys that were dropped."""
        dropped, ready = [], EntryState.READY
        for slot in slots:
            if self._retired[slot]:
                continue
            self._retired[slot] = 1
            self._num_retired += 1
            key = self._key_at[slot]
            if self._is_free[slot]:
                self._is_free[slot] = 0
                self._num_free -= 1
            elif key is not None and self._entries[key].state is ready:
                self.discard(key)
                dropped.append(key)
        return dropped

    def unretire(self, slots: range) -> None:
        """Put retired ``slots`` back in service; one still held (pinned by a reader, or
        being written) is freed when its holder lets go."""
        key_at = self._key_at
        for slot in slots:
            if not self._retired[slot]:
                continue
            self._retired[slot] = 0
            self._num_retired -= 1
            if key_at[slot] is None:
                self._is_free[slot] = 1
                self._num_free += 1
                self._list(slot)

    def adopt_retired(self, key: ChunkKey, slot: int, first: bool = False) -> bool:
        """Put a retired ``slot`` back in service holding ``key`` as ``adopt`` does, or free
        when ``key`` is held already (False); False, changing nothing, when ``slot`` is not
        retired or an entry holds it (``unretire`` frees it once let go)."""
        if not self._retired[slot] or self._key_at[slot] is not None:
            return False
        self._retired[slot] = 0
        self._num_retired -= 1
        self._is_free[slot] = 1
        self._num_free += 1
        if self.adopt(key, slot, first):
            return True
        self._list(slot)
        return False

    def _list(self, slot: int) -> None:
        """Put a free ``slot`` on the free list, unless it is there already or was never
        handed out (``_fresh`` hands it out)."""
        if slot < self._fresh and not self._listed[slot]:
            self._listed[slot] = 1
            self._free.append(slot)

    def _take_free(self) -> int:
        while True:  # skip slots adopted since they were listed
            if self._free:
                slot = self._free.pop()
                self._listed[slot] = 0
            else:
                slot, self._fresh = self._fresh, self._fresh + 1
            if self._is_free[slot]:
                self._is_free[slot] = 0
                self._num_free -= 1
                return slot

    def _release(self, slot: int) -> None:
        assert not self._is_free[slot], "slot freed twice"
        self._key_at[slot] = None
        if self._retired[slot]:
            return
        self._is_free[slot] = 1
        self._num_free += 1
        self._list(slot)
