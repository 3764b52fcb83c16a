"""KV events: what kvtier's tiers gain and lose, told through vLLM's own KV event stream.

A KV-aware router (vllm-router's ``kv_aware`` policy) follows each engine's events and
credits the blocks it holds per tier by the event's ``medium``. vLLM publishes its GPU
blocks; kvtier adds, through the connector's ``take_events()``, the chunks its host tier
(``CPU``) and disk tier (``STORAGE``: vLLM's names, which vllm-router maps to its host and
disk tiers) gain and lose. A chunk's event names each of its blocks as vLLM's own
``BlockStored`` does: vLLM's hash of each block of ``block_size`` tokens (chained over the
prefix, salt and adapter), the hash of the block before the chunk, the chunk's token ids.

A chunk this engine stored is named from the request it came with. A chunk on disk since
before this start, or in another engine's segment of a shared directory, is named from
the token record in its slot's header (``storage_events.py``), or once a request with its
tokens comes. ``STORAGE`` stands for both: a chunk is stored there while this engine's
disk or another segment it follows holds it, removed when neither does. A prompt's tail
(its last block is partial: vLLM has no hash for it) is not published. A chunk of the
remote store is published by every engine that follows the store's log of token records,
as stored with ``locality`` REMOTE and ``ownership`` ``OWNERSHIP`` (``remote_events.py``).
Events are hints, never promises.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.event_backlog import EventBacklog
from kvtier.connector.scheduler.event_retell import Retell
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierName

MEDIUMS = {TierName.HOST: "CPU", TierName.DISK: "STORAGE"}  # vLLM's MEDIUM_CPU, MEDIUM_STORAGE
OWN_DISK, SHARED = 1, 2  # who holds a chunk in STORAGE: this engine's disk, others' segments
OWNERSHIP = "kvtier"  # a remote store's chunks: locality REMOTE, this ownership
QUEUE_LIMIT = 65536  # stored changes waiting for vLLM's takes; the oldest dropped past it
TAKE_CHANGES = 4096  # chunks' changes handed over in one take (a step), at most
PLACES = ((MEDIUMS[TierName.HOST], False), (MEDIUMS[TierName.DISK], False),
          (MEDIUMS[TierName.DISK], True))  # where a chunk is published: medium, remote


@dataclass(frozen=True, slots=True)
class ChunkBlocks:
    """What an event says of one chunk: vLLM's hash of each of its blocks, the hash of the
    block before it (None for a prompt's first chunk), its token ids, the adapter, and
    what else vLLM hashed of each block (``extra_keys``: salt, adapter, multimodal inputs;
    None when nothing)."""

    hashes: tuple[bytes, ...]
    parent: bytes | None
    tokens: array  # the chunk's token ids (4 bytes each)
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple | None = None


class EventFactory(Protocol):
    """Makes vLLM's event objects (``connector.py``'s ``VllmEvents``), so that this module
    imports without vLLM: one event per KV cache group; and says what else vLLM hashed of
    each block of a request's tokens ``start`` to ``stop`` (None: nothing)."""

    def extra_keys(self, request: Any, start: int, stop: int) -> tuple | None: ...

    def stored(self, blocks: ChunkBlocks, medium: str, remote: bool = False) -> list[Any]: ...

    def removed(self, blocks: ChunkBlocks, medium: str, remote: bool = False) -> list[Any]: ...


def chunk_blocks(request: Any, geometry: KVGeometry, chunk: int,
                 extra: Callable[[Any, int, int], tuple | None] | None = None) -> ChunkBlocks | None:
    """Chunk ``chunk`` of ``request`` as its events name it, or None while vLLM has not
    hashed all its blocks. vLLM hashes every ``hash_block_tokens``; a block's hash is the
    hash at its end (``resolve_block_hashes``), as its own ``BlockStored`` events say."""
    scale = geometry.block_tokens // geometry.hash_block_tokens
    per = geometry.blocks_per_chunk
    first = chunk * per
    hashes = request.block_hashes
    if len(hashes) < (first + per) * scale:
        return None
    start = chunk * geometry.chunk_tokens
    lora = getattr(request, "lora_request", None)
    return ChunkBlocks(
        tuple(bytes(hashes[(b + 1) * scale - 1]) for b in range(first, first + per)),
        bytes(hashes[first * scale - 1]) if first else None,
        array("i", request.all_token_ids[start:start + geometry.chunk_tokens]),
        getattr(lora, "adapter_id", None) if lora else None,
        getattr(lora, "name", None) if lora else None,
        extra(request, start, start + geometry.chunk_tokens) if extra else None)


class KVEvents:
    """kvtier's KV events, collected on the scheduler side and taken by vLLM each step.

    Contract: ``record(key, request, chunk)`` keeps what events need of a chunk planned for
    store (a chunk recorded once keeps its first record), ``seen`` one found cached without
    a record (published then in the tiers holding it); ``stored(key, tier)`` and
    ``removed(key, tier)`` queue an event for a recorded chunk in a tier with a medium
    (others are ignored; ``STORAGE`` only when it starts or stops holding the chunk);
    ``found(key, blocks, ...)`` records a chunk named by its token record, stored on this
    engine's disk (if ``on_disk``) or in another engine's segment (``shared``);
    ``shared_gone(key)`` says no other segment holds it any more; ``found_remote(key,
    blocks)`` and ``remote_gone(key)`` the same of the remote store (published with
    ``remote``); ``left(key)`` marks a chunk that may be in no tier any more: its record
    is dropped at the next ``take`` unless ``still_held(key)``, ``STORAGE`` or the remote
    store holds it. ``take()`` returns the events since the last one, oldest first, as
    each chunk's net change per medium (``EventBacklog``: a chunk stored and removed in
    between is not told), at most ``per_take`` chunks' changes: the rest wait for the next
    take. Past ``limit`` stored changes waiting the oldest is dropped, counted in
    ``counters["kv_events_dropped"]`` (and the chunk's removal that follows, which the
    router would ignore); a removal of a chunk the router was told of is never dropped.
    ``counters["kv_events"]`` counts the events taken. A chunk stored again goes after
    its parent's stored change waiting, unless the router holds the parent already.
    ``router_cleared()``: the router forgot every chunk while the tiers still hold them
    (vLLM's plain cache reset): each one it had been told of, or was to be, is told
    again as room in the takes allows (``Retell``; ``retelling`` until every change
    waiting then and since is taken), each after its ancestors waiting, told first; a
    chunk stored meanwhile goes after its parent too, and ``published`` counts a parent
    waiting to be told again. Nothing here blocks or does I/O.
    """

    def __init__(self, geometry: KVGeometry, factory: EventFactory, counters: Counter,
                 limit: int = QUEUE_LIMIT, per_take: int = TAKE_CHANGES) -> None:
        self.geometry, self.factory, self.counters = geometry, factory, counters
        self.still_held: Callable[[ChunkKey], bool] = lambda key: False
        self._blocks: dict[ChunkKey, ChunkBlocks] = {}
        self._backlog, self._limit, self.per_take = EventBacklog(limit, counters), limit, per_take
        self._left: set[ChunkKey] = set()
        self._storage: dict[ChunkKey, int] = {}  # OWN_DISK | SHARED: who holds it there
        self._remote: set[ChunkKey] = set()  # published as held by the remote store
        self._keys: dict[bytes, ChunkKey] = {}  # the recorded chunks by their last block hash
        self._retell = Retell(PLACES)  # to be told again after the router forgot them
        self._retelling = False  # since the router forgot all, until every change is taken

    def __len__(self) -> int:
        """Chunks recorded."""
        return len(self._blocks)

    def clear(self, router_told: bool = True) -> None:
        """Forget every chunk and every change waiting: no chunk held now is loaded again.
        Unless ``router_told`` (by vLLM's ``AllBlocksCleared``; not when its own reset
        failed, blocks in use), the removal of each chunk the router holds is queued."""
        told = [] if router_told else self._backlog.told(self._blocks)
        self._blocks, self._left, self._storage, self._remote, self._keys = {}, set(), {}, set(), {}
        self._backlog = EventBacklog(self._limit, self.counters, removals=told)
        self._retell, self._retelling = Retell(PLACES), bool(told)  # an idle engine steps

    def router_cleared(self) -> None:
        slots = self._backlog.cleared()
        self.counters["kv_events_retold"] += len(slots)
        self._retell.add(slots)
        self._retelling = self._retelling or bool(slots)

    @property
    def retelling(self) -> bool:
        return self._retelling

    def published(self, block_hash: bytes) -> bool:
        """Whether the router holds a chunk ending with block ``block_hash`` once the events
        waiting are taken (its stored event was taken and no removal since, or one waits):
        a chunk whose parent it is, queued now, follows it (``anchors.py``). A chunk whose
        stored event was cancelled, dropped or followed by its removal is not."""
        key = self._keys.get(block_hash)
        return key is not None and (any(self._backlog.held((key, *place)) for place in PLACES)
                                    or bool(self._retell.of(key)))

    def record(self, key: ChunkKey, request: Any, chunk: int,
               blocks: ChunkBlocks | None = None) -> None:
        """Keep what events need of chunk ``chunk`` of ``request`` (``blocks`` when the
        caller has it already)."""
        if key not in self._blocks:
            if blocks is None:
                blocks = chunk_blocks(request, self.geometry, chunk, self.factory.extra_keys)
            if blocks is not None:
                self._keep(key, blocks)

    def seen(self, key: ChunkKey, request: Any, chunk: int, tiers: list[TierName]) -> None:
        """A chunk found cached with no record (on disk since before this start, say):
        recorded, and published as stored in ``tiers``, where it is visible."""
        if key not in self._blocks:
            self.record(key, request, chunk)
            for tier in tiers:
                self.stored(key, tier)

    def stored(self, key: ChunkKey, tier: TierName) -> None:
        self._put(True, key, tier)

    def removed(self, key: ChunkKey, tier: TierName) -> None:
        self._put(False, key, tier)

    def found(self, key: ChunkKey, blocks: ChunkBlocks, *, shared: bool, on_disk: bool) -> None:
        self._keep(key, blocks)
        if shared:
            self._storage_change(True, key, SHARED)
        elif on_disk:
            self.stored(key, TierName.DISK)
        else:
            self.left(key)

    def found_remote(self, key: ChunkKey, blocks: ChunkBlocks) -> None:
        self._keep(key, blocks)
        if key not in self._remote:
            self._remote.add(key)
            self._queue_event(True, key, MEDIUMS[TierName.DISK], remote=True)

    def remote_gone(self, key: ChunkKey) -> None:
        if key in self._remote:
            self._remote.discard(key)
            self._queue_event(False, key, MEDIUMS[TierName.DISK], remote=True)
            self.left(key)

    def shared_gone(self, key: ChunkKey) -> None:
        if self._storage.get(key, 0) & SHARED:
            self._storage_change(False, key, SHARED)
            self.left(key)

    def left(self, key: ChunkKey) -> None:
        if key in self._blocks:
            self._left.add(key)

    def _keep(self, key: ChunkKey, blocks: ChunkBlocks) -> None:
        if key not in self._blocks:
            self._blocks[key] = blocks
            self._keys.setdefault(blocks.hashes[-1], key)

    def _put(self, stored: bool, key: ChunkKey, tier: TierName) -> None:
        if tier is TierName.DISK:
            self._storage_change(stored, key, OWN_DISK)
        elif tier in MEDIUMS:
            self._queue_event(stored, key, MEDIUMS[tier])

    def _storage_change(self, stored: bool, key: ChunkKey, holder: int) -> None:
        if key not in self._blocks:
            return
        before = self._storage.get(key, 0)
        after = before | holder if stored else before & ~holder
        if after:
            self._storage[key] = after
        else:
            self._storage.pop(key, None)
        if bool(before) != bool(after):
            self._queue_event(stored, key, MEDIUMS[TierName.DISK])

    def _queue_event(self, stored: bool, key: ChunkKey, medium: str, remote: bool = False) -> None:
        if self._retell.drop((key, medium, remote)) and not stored:
            return  # gone before it was told again: the router holds nothing of it
        blocks = self._blocks.get(key)
        if blocks is None:
            return
        if stored:
            self._tell_ancestors(key)
        after = self._parent_place(blocks) if stored else -1
        self._backlog.change(stored, (key, medium, remote), blocks, after)

    def _parent_key(self, key: ChunkKey) -> ChunkKey | None:
        blocks = self._blocks.get(key)
        return None if blocks is None or blocks.parent is None else self._keys.get(blocks.parent)

    def _tell_ancestors(self, key: ChunkKey) -> None:
        """The ancestors of chunk ``key`` waiting to be told again are told now, first."""
        for slot in self._retell.ancestors(key, self._parent_key):
            self._queue_event(True, *slot)

    def _parent_place(self, blocks: ChunkBlocks) -> int:
        """The place of the parent's first stored change waiting, which a chunk of
        ``blocks`` stored again must follow; -1 when none waits or the router holds the
        parent already (a stored change taken, and nothing waiting)."""
        key = None if blocks.parent is None else self._keys.get(blocks.parent)
        if key is None:
            return -1
        places = []
        for place in PLACES:
            slot = (key, *place)
            waiting = self._backlog.place(slot)
            if waiting is None and self._backlog.held(slot):
                return -1
            if waiting is not None:
                places.append(waiting)
        return min(places, default=-1)

    def take(self) -> list[Any]:
        for key in self._left:
            if not self.still_held(key) and key not in self._storage and key not in self._remote:
                blocks = self._blocks.pop(key, None)
                if blocks is not None and self._keys.get(blocks.hashes[-1]) == key:
                    del self._keys[blocks.hashes[-1]]
        self._left.clear()
        for slot in self._retell.next(self.per_take - len(self._backlog)):
            if self._retell.drop(slot):  # one at a time: those after it wait while it is told
                self._queue_event(True, *slot)
        events: list[Any] = []
        for stored, (_, medium, remote), blocks in self._backlog.take(self.per_take):
            make = self.factory.stored if stored else self.factory.removed
            events += make(blocks, medium, remote=True) if remote else make(blocks, medium)
        self.counters["kv_events"] += len(events)
        self._retelling = self._retelling and bool(len(self._retell) or len(self._backlog))
        return events
