"""What the scheduler side keeps between steps, and when each record is made and dropped.

- ``Tracked``: one per request vLLM has shown the connector, made on its first call about
  the request (``SchedulerSide.track``) and dropped by ``request_finished``.
- ``Load``: one per request whose load is planned, made by ``LoadPlanner.plan`` and dropped
  by ``LoadPlanner.finish`` once every rank reported the load over; its pins and staging
  reservations end then.
- ``PendingStores``: the chunks the workers are storing, each from the step its store (or
  demotion) is planned until every rank reported its outcome.
- ``StalledReads``: a failed load's staging reservation, held while a read given up on may
  still be filling its slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.connector.common.messages import DiskWrite
from kvtier.connector.scheduler.rank_counts import RankCount
from kvtier.connector.scheduler.tails import Tail
from kvtier.keys import ChunkKey
from kvtier.shared.reads import SlotRef
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import Location, Move, StorePlan, TierStack


@dataclass
class Tracked:
    """What the scheduler side keeps of one request until vLLM says it finished."""

    request: Any  # vLLM's Request
    stored_upto: int = 0  # chunks already offered for store
    computed: int = 0  # its most tokens computed at a step planning stores
    store_done: bool = False  # no later chunk can be stored (its pages left a window)
    asynchronous: bool = False  # what the last match promised vLLM
    visible: int | None = None  # tokens its last match found cached, before any cut
    waiting_since: float | None = None  # when it began to wait for host slots to stage in
    tail: Tail | None = None  # its prompt's partial last chunk (``tails.prompt_tail``)
    tail_for: int | None = None  # the prompt length ``tail`` was worked out for
    tail_done: bool = False  # the tail was offered for store (or needs none)
    tail_stored: bool = False  # the tail was offered, or found cached

    def offered_tokens(self, chunk_tokens: int) -> int:
        """The prompt tokens whose chunks were offered for store (or found cached), in
        order from the first: full chunks, then the tail when every chunk before it was."""
        tail = self.tail
        if self.tail_stored and tail is not None and self.stored_upto >= tail.index:
            return tail.end
        return self.stored_upto * chunk_tokens
    verify: bool = False  # sampled (``verify_sample``): a miss to vLLM, its hits checked
    verify_asked: bool = False  # the sampling was decided for it (once per request)
    verify_from: int = 0  # its first chunk vLLM computes (those before: vLLM's own hit)
    verify_remote: frozenset = frozenset()  # its chunks the remote store said it holds
    adapter: bytes | None = None  # its LoRA adapter's part of its keys, once known
    adapter_since: float | None = None  # when it first waited for its adapter to be read
    epoch: bytes = b""  # what a cache reset adds to its keys (``Handoffs.epoch_of``)


@dataclass
class Load:
    """A request's load in flight: what is pinned, and staging slots to finish."""

    pinned: list[tuple[ChunkKey, Location]]
    staged: list[StorePlan]
    tokens: int
    tiers: dict[TierName, int]  # tokens loaded from each tier
    asynchronous: bool = False  # from disk: the request waits for it between steps
    cut: bool = False  # a chunk could not be loaded: it and the ones after are recomputed
    other: dict[ChunkKey, tuple[SlotRef, ...]] = field(default_factory=dict)  # other engines'
    remote: set[ChunkKey] = field(default_factory=set)  # read from the remote store
    partial: set[ChunkKey] = field(default_factory=set)  # read in part: staged, never kept
    request: Any = None  # vLLM's Request: its chunks' token records, where a hit earns a write
    chunks: dict[ChunkKey, int] = field(default_factory=dict)  # each chunk's index in it
    order: tuple[ChunkKey, ...] = ()  # the chunks it loads, head first
    keys: frozenset[ChunkKey] = frozenset()  # the same, for its staging to evict them last


@dataclass
class PendingStores:
    """Chunks the workers are storing: host reservations, then write-through disk writes.

    Contract: a key is in ``host`` from its planned store until every rank reported it,
    with its host slot and its write-through disk slot (None: none planned); a key is in
    ``disk`` from its planned disk write until every rank reported it, with its disk slot
    and the host slot pinned until the write is over (None: a demotion's, not pinned).
    """

    host: dict[ChunkKey, tuple[Location, Location | None]] = field(default_factory=dict)
    disk: dict[ChunkKey, tuple[Location, Location | None]] = field(default_factory=dict)
    # write-back victims being written to disk, by the host slot they leave, and back
    demoting: dict[int, ChunkKey] = field(default_factory=dict)
    _leaving: dict[ChunkKey, set[int]] = field(default_factory=dict)

    def demotion_writes(self, moves: tuple[Move, ...]) -> list[DiskWrite]:
        """Host victims that must reach disk before their slot is reused (write-back),
        each recorded pending."""
        writes = []
        for move in moves:
            assert move.src.tier is TierName.HOST and move.dst.tier is TierName.DISK, move
            writes.append(DiskWrite(move.key, move.src.slot, move.dst.slot))
            self.disk[move.key] = (move.dst, None)
            if (before := self.demoting.get(move.src.slot)) is not None:
                self._leaving[before].discard(move.src.slot)
            self.demoting[move.src.slot] = move.key
            self._leaving.setdefault(move.key, set()).add(move.src.slot)
        return writes

    def demoted(self, key: ChunkKey) -> None:
        """``key``'s disk write is over: if it was a demotion, its host slot is left (O(1):
        a report ending thousands of them at once was O(n^2))."""
        for slot in self._leaving.pop(key, ()):
            del self.demoting[slot]


class AbortedStores:
    """Host reservations of stores some rank failed while other ranks may still read the
    slot (their write-through disk writes, their remote writes).

    Contract: ``hold(key, host, readers)`` keeps ``host`` reserved for ``readers`` outcomes
    still to come (more of them, for a reservation held already); each ``release(key)``
    ends one, and the last ends the reservation (``TierStack.finish``, not visible). ``key
    in`` says whether one is held. ``after_write_back(key, host, pending)`` holds ``host``
    for the write-back of its victim still running from it (a ``pending.demoting`` victim
    whose disk write is in ``pending.disk``; True when there is one), until
    ``written_back(victim)``.
    """

    def __init__(self, stack: TierStack) -> None:
        self._stack = stack
        self._held: dict[ChunkKey, list] = {}  # key -> [host location, readers left]
        self._after: dict[ChunkKey, ChunkKey] = {}  # victim written back -> key held for it

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def hold(self, key: ChunkKey, host: Location, readers: int) -> None:
        held = self._held.get(key)
        assert readers > 0 and (held is None or held[0] == host), (key, readers)
        self._held[key] = [host, readers + (held[1] if held else 0)]

    def after_write_back(self, key: ChunkKey, host: Location, pending: PendingStores) -> bool:
        victim = pending.demoting.get(host.slot)
        if victim is None or victim not in pending.disk:
            return False
        self.hold(key, host, 1)
        self._after[victim] = key
        return True

    def written_back(self, victim: ChunkKey) -> None:
        if victim in self._after:
            self.release(self._after.pop(victim))

    def release(self, key: ChunkKey) -> None:
        held = self._held.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del self._held[key]
            self._stack.finish(key, held[0], False)


class StalledReads:
    """Disk reads given up on (their load failed) that may still be writing into their
    host staging slot.

    Contract: ``stalled(key, ranks)`` counts ranks whose read of ``key`` still runs;
    ``hold(plan)`` keeps a failed load's staging reservation and returns True while any
    such rank's read of ``plan.key`` runs (False: none does, the caller ends it now);
    ``over(key, ranks)`` returns the held reservation to end once the last such rank's
    read is over, else None; ``len()`` is the number of staging slots held.
    """

    def __init__(self) -> None:
        self._ranks = RankCount()  # key -> ranks whose given-up read still runs
        self._plans: dict[bytes, StorePlan] = {}  # their staging slots, held till then

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, key: object) -> bool:
        """Whether ``key``'s staging slot is held by a read given up on."""
        return key in self._plans

    def stalled(self, key: ChunkKey, ranks: int) -> None:
        self._ranks.up(key, ranks)

    def hold(self, plan: StorePlan) -> bool:
        if self._ranks[plan.key] <= 0:
            return False
        self._plans[plan.key] = plan
        return True

    def over(self, key: ChunkKey, ranks: int) -> StorePlan | None:
        if not self._ranks.down(key, ranks):
            return None
        return self._plans.pop(key, None)
