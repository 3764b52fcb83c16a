"""Matching a request's chunks: how many tokens beyond those vLLM computed can load, from
where, pinning nothing (``LoadMatcher.match``)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvtier.config.settings import KVTierConfig
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.decider import LoadDecider
from kvtier.connector.scheduler.records import StalledReads, Tracked
from kvtier.connector.scheduler.remote_presence import RemotePresence
from kvtier.keys import ChunkKey
from kvtier.shared.follower import OtherWriters
from kvtier.shared.reads import SlotRef
from kvtier.tiers.base import TierName
from kvtier.tiers.prefix import InOther, InRemote, Ours, find, walk_cached, walk_remote
from kvtier.tiers.stack import TierStack

HOST, DISK, SHARED, REMOTE = TierName.HOST, TierName.DISK, TierName.SHARED, TierName.REMOTE
READ = (DISK, SHARED, REMOTE)  # chunks read into a host slot before they load


@dataclass(frozen=True)
class Computed:
    """A chunk vLLM computed already: never loaded."""

    tier: ClassVar[TierName] = TierName.GPU


COMPUTED = Computed()
Matched = Computed | Ours | InOther[tuple[SlotRef, ...]] | InRemote  # where a matched chunk is


class LoadMatcher:
    """The match half of ``LoadPlanner``: reads the bookkeeping, reserves nothing."""

    def __init__(self, config: KVTierConfig, geometry: KVGeometry, stack: TierStack,
                 decider: LoadDecider, counters: Counter, stalled: StalledReads,
                 others: OtherWriters | None, presence: RemotePresence | None) -> None:
        self.config, self.geometry, self.stack, self.decider = config, geometry, stack, decider
        self.counters, self._stalled, self.others, self.presence = counters, stalled, others, presence

    def match(self, tracked: Tracked, keys: list[ChunkKey], limit: int,
              num_computed: int) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed`` (at most ``limit``) of the request whose
        chunks have ``keys``; see ``SchedulerSide.num_new_matched_tokens``."""
        chunk = self.geometry.chunk_tokens
        locations = self._match(keys, tracked.request.request_id, num_computed // chunk)
        if locations is None:
            tracked.visible = None
            return None, False
        hit = min(len(locations) * chunk, limit)
        wanted = tracked.visible = hit - num_computed
        if wanted <= 0 or self._partial(tracked, hit):
            return 0, False
        first = num_computed // chunk
        matched = locations[first:]
        patient = self._patient(tracked)
        loadable = self._loadable(keys[first:len(locations)], matched, first, hit, patient)
        if loadable is None:
            return None, False
        if self._ask_again(tracked, keys[first:], matched, wanted, first, hit, loadable):
            return None, False
        tracked.waiting_since = None
        loadable, end = self._fit(keys, matched, first, hit, loadable, patient)
        if loadable is None:
            return None, False
        needed = matched[:loadable]
        wanted = end - num_computed
        if wanted <= 0 or self._partial(tracked, end):
            self.counters["load_cut_chunks"] += len(matched) - loadable
            return 0, False
        from_disk = sum(1 for loc in needed if loc.tier in READ)
        if not self.decider.should_load(wanted, *self._load_bytes(needed, first, end)):
            return 0, False
        self.counters["load_cut_chunks"] += len(matched) - loadable
        # From host memory the copy is quick: done before this step's forward. From disk the
        # request waits (asynchronously) while other requests go on. Loads that must fail
        # whole (hybrid or sliding-window models) are all asynchronous: vLLM takes a failed
        # load back as a request only then.
        tracked.asynchronous = from_disk > 0 or self.geometry.loads_whole
        return wanted, tracked.asynchronous

    def _partial(self, tracked: Tracked, end: int) -> bool:
        """Whether a load up to token ``end`` leaves vLLM more than one token to compute where
        its attention cannot go on from a partial hit (``reference_mla``)."""
        return self.geometry.reference_cpu_mla and end < tracked.request.num_tokens - 1

    def _fit(self, keys: list[ChunkKey], matched: Sequence[Matched], first: int, hit: int,
             loadable: int, patient: bool) -> tuple[int | None, int]:
        """(chunks that can load, the load's end) once a hit of ``matched`` (chunks ``first``
        on, up to token ``hit``) is cut to its first ``loadable`` chunks: a window ends where
        the load ends, so the cut moves it onto chunks that needed nothing before, which may
        need host slots now (a model whose every group is windowed). None: ask again."""
        chunk = self.geometry.chunk_tokens
        end = min(hit, (first + loadable) * chunk)
        while loadable < len(matched):
            fit = self._loadable(keys[first:first + loadable], matched[:loadable], first, end,
                                 patient)
            if fit is None or fit >= loadable:
                return fit, end
            loadable, end = fit, min(hit, (first + fit) * chunk)
        return loadable, end

    def _match(self, keys: list[ChunkKey], req_id: str, computed: int) -> list[Matched] | None:
        """The longest run of ``keys`` cached here, or in another engine's segment (a
        location of tier SHARED), each where it is hottest, then in the remote store (tier
        REMOTE, but for those of its chunks cached here after all); None while the store has
        not answered yet. The first ``computed`` chunks
        vLLM holds already count as found (``COMPUTED``): one of them missing here hides no
        later chunk (a key names its whole prefix, so a later hit is still the right one)."""
        start: list[Matched] = [COMPUTED] * min(computed, len(keys))
        theirs = self.others.find if self.others else None
        found = start + walk_cached(keys[len(start):], self.stack.locate, theirs)
        # past a chunk only the store holds, a chunk cached here is taken from here: read
        # from the store it would want a staging slot, and a chunk visible in host memory
        # would look as if another load were staging it, for ever
        remote = walk_remote(keys[len(found):], self._remote_held(req_id, keys),
                             lambda key: find(key, self.stack.locate, theirs))
        return None if remote is None else [*found, *remote]

    def _remote_held(self, req_id: str, keys: list[ChunkKey]
                     ) -> Callable[[Sequence[ChunkKey]], list[bool] | None] | None:
        """The remote store's answer for a tail of the request's ``keys`` (asked once per
        request, for all of them: ``RemotePresence.held``)."""
        presence = self.presence
        if presence is None:
            return None

        def held(tail: Sequence[ChunkKey]) -> list[bool] | None:
            answer = presence.held(req_id, keys)
            return None if answer is None else answer[len(keys) - len(tail):]

        return held

    def _ask_again(self, tracked: Tracked, keys: list[ChunkKey], matched: Sequence[Matched],
                   wanted: int, first: int, end: int, loadable: int) -> bool:
        """Whether a hit cut to its first ``loadable`` chunks should ask again rather than
        recompute the rest (``_wait_for_room``): never where the cut is at a chunk whose
        staging slot a read given up on holds (it may never end)."""
        if loadable >= len(matched) or keys[loadable] in self._stalled:
            return False
        return self._wait_for_room(tracked, matched, wanted, first, end)

    def _patient(self, tracked: Tracked) -> bool:
        """Whether the request may still wait for a chunk another load stages: until it has
        waited ``staging_wait`` (the clock ``_wait_for_room`` keeps too)."""
        limit = self.config.staging_wait
        if limit is None:
            return False
        now = time.monotonic()
        if tracked.waiting_since is None:
            tracked.waiting_since = now
        return now - tracked.waiting_since < limit

    def _wait_for_room(self, tracked: Tracked, matched: Sequence[Matched], wanted: int,
                       first: int, end: int) -> bool:
        """Whether a request whose hits do not all fit in the host slots free now should ask
        again next step rather than recompute the rest: the slots are held by loads and
        stores in flight, which give them back within a step or two. Not when the hits could
        not fit even then (host memory too small, or slots held by reads a hung disk has not
        answered), when loading them would not pay (``load_policy``), or once the request has
        waited ``staging_wait``."""
        limit = self.config.staging_wait
        slots = sum(1 for n in range(len(matched)) if self.geometry.bytes_needed(first + n, end))
        if limit is None or slots > self.stack.indexes[HOST].num_slots - len(self._stalled):
            return False
        now = time.monotonic()
        if tracked.waiting_since is None:
            tracked.waiting_since = now
        if now - tracked.waiting_since >= limit:
            return False
        if not self.decider.would_load(wanted, *self._load_bytes(matched, first, end)):
            return False
        self.counters["room_waits"] += 1
        return True

    def _load_bytes(self, locations: Sequence[Matched], first: int, end: int) -> tuple[int, int]:
        """(bytes read from disk, bytes in all) to load the chunks at ``locations`` (chunks
        ``first`` on) up to token ``end``: only the groups' parts that keep blocks there."""
        sizes = [self.geometry.bytes_needed(first + n, end) for n in range(len(locations))]
        return (sum(size for size, loc in zip(sizes, locations, strict=True) if loc.tier in READ),
                sum(sizes))

    def _loadable(self, keys: list[ChunkKey], locations: Sequence[Matched], first: int,
                  end: int, patient: bool) -> int | None:
        """How many of the matched chunks (in order, chunks ``first`` on) can load now, up to
        token ``end``: each holds a host slot while it loads (a disk read needs one to stage
        in; a host chunk not yet pinned takes one out of reach when this load pins it), but
        for a chunk out of every group's window (nothing to copy). A chunk whose host slot is
        taken but not filled yet ends them: None (ask again) while ``patient`` and another
        load stages it; else there, as where a read given up on holds the slot (a hung
        drive's read may never end), or a store some rank failed does."""
        host = self.stack.indexes[HOST]
        room = host.reusable_slots
        for n, (key, loc) in enumerate(zip(keys, locations, strict=True)):
            if loc.tier in READ and host.has_entry(key):
                return None if patient and key not in self._stalled else n
            if not self.geometry.bytes_needed(first + n, end):
                continue
            cost = 0 if loc.tier is HOST and host.pinned(key) else 1
            if cost > room:
                return n
            room -= cost
        return len(locations)
