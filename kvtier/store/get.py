"""One ``KVStore.get``: the read window over a prefix's chunks, copied out in order."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from kvtier.io.batch_reads import READ_GROUP_BYTES
from kvtier.keys import ChunkKey
from kvtier.store.chunk_runs import Run
from kvtier.store.direct import DirectTarget
from kvtier.store.fetch import Fetch, FetchState
from kvtier.store.reads import Fetcher
from kvtier.store.skip import Skip
from kvtier.store.state import DISK, HOST, StoreState
from kvtier.store.writes import PlanRunner
from kvtier.tiers.base import TierName
from kvtier.tiers.prefix import IN_REMOTE, walk_remote
from kvtier.tiers.stack import Location
from kvtier.units import time_left

HELD_POLL_S = 0.001  # how often a get whose every host slot others hold looks again


class PrefixRead:
    """Reads ``keys`` in order into the caller's tensor, up to the first chunk not served.

    Up to ``read_ahead`` chunks are fetched at once (pinned, their disk reads in flight, in
    groups of neighbouring slots: ``Fetcher.start``); each is verified, copied out and
    promoted to the top tier in turn. Past the prefix cached here, the remote store is
    asked once which chunks it holds; those are read into host slots like disk chunks.
    With a ``direct`` target (the caller's tensor is a
    direct buffer) a chunk's first read from disk lands in the tensor itself: nothing to
    copy, and it stays on disk until it is read again. The first chunk not
    cached, failing its check or given up on ends the prefix; the fetches past it are
    dropped. Whatever happens, every pin and staging slot is given back.

    A chunk another ``get`` is reading into host memory (``Skip.BUSY``) is waited for, at
    most ``load_timeout``, once this window is empty, then found in host memory (or read
    again, or missed, when that read failed). Waiting with an empty window holds no
    reservation another ``get`` could need, so two gets never wait for each other.
    """

    def __init__(self, state: StoreState, fetcher: Fetcher, runner: PlanRunner,
                 read_ahead: int, drain_timeout: float, direct: DirectTarget | None = None) -> None:
        self._state, self._fetcher, self._runner = state, fetcher, runner
        self._direct = direct
        self._read_ahead, self._drain_timeout = read_ahead, drain_timeout
        group = max(1, READ_GROUP_BYTES // state.transfers.chunk_bytes)
        self._refill = min(group, read_ahead)  # free places in the window worth a refill
        self._window: deque[Fetch] = deque()
        self._issued, self._ended, self._may_wait = 0, False, True
        self._wait_until: float | None = None  # the end of this get's waits for room
        self._remote: set[ChunkKey] = set()  # keys past the cached prefix the remote store holds
        self._spare: frozenset[ChunkKey] = frozenset()  # this get's: evicted for its reads last
        self._held: list[tuple[ChunkKey, Location]] = []  # this get's disk chunks, pinned
        self.loaded: list[TierName] = []

    def run(self, keys: list[ChunkKey], chunks_out: Callable[[int, int], Run]) -> int:
        """Copy the prefix into the caller's tensor, ``chunks_out(i, n)`` being its chunks
        ``i`` to ``i + n - 1`` as one ``(n, layers, 2, chunk_tokens, hidden)`` view; return
        the prefix's chunks."""
        self._held = self._fetcher.hold_disk_chunks(keys)
        self._spare = frozenset(keys)  # a read's staging slot never evicts a later chunk of it
        try:
            self._remote = self._remote_tail(keys)
            if self._remote:  # the window refills by the remote tier's groups
                assert self._state.remote is not None
                group = self._state.remote.tier.read_group_bytes // self._state.transfers.chunk_bytes
                self._refill = max(self._refill, min(group, self._read_ahead))
            while self._fill(keys):
                fetches = self._next_run()
                try:
                    if not self._copy(fetches, chunks_out):
                        break
                finally:
                    self._fetcher.release(*fetches)
        finally:
            self._finish(self._held, len(keys))
        return len(self.loaded)

    def _next_run(self) -> list[Fetch]:
        """The window's first fetch, and the chunks after it held in the slots that follow
        its own in the same memory tier: they are copied out together."""
        run = [self._window.popleft()]
        while run[0].state is FetchState.HOT and self._window:
            last, after = run[-1].loc, self._window[0]
            if after.state is not FetchState.HOT or after.loc.tier is not last.tier \
                    or after.loc.slot != last.slot + 1:
                break
            run.append(self._window.popleft())
        return run

    def _remote_tail(self, keys: list[ChunkKey]) -> set[ChunkKey]:
        """The keys past the prefix cached here (or in a shared directory) that the remote
        store is to serve: those of the walk on (``walk_remote``) held only there. One round
        trip, only when some are not cached."""
        remote, others = self._state.remote, self._state.others
        if remote is None:
            return set()
        books, theirs = self._state.books, others.find if others else None
        tail = keys[len(books.cached(keys, theirs)):]
        past = walk_remote(tail, remote.held, lambda key: books.find(key, theirs)) or ()
        return {key for key, where in zip(tail, past, strict=False) if where is IN_REMOTE}

    def _fill(self, keys: list[ChunkKey]) -> bool:
        """Once a whole read group fits in the window, begin fetches up to its size, starting
        the reads of each group together as soon as it is begun (so they go to the disk in
        groups); True while one waits."""
        if self._window and self._read_ahead - len(self._window) < self._refill:
            return True
        begun: list[Fetch] = []
        try:
            while not self._ended and self._issued < len(keys) and len(self._window) < self._read_ahead:
                fetch = self._begin(keys[self._issued])
                if fetch in (Skip.NO_ROOM, Skip.NO_ROOM_BELOW, Skip.BUSY) and self._window:
                    break  # host slots held by this window, or a wait: complete one first
                if not isinstance(fetch, Fetch):
                    self._ended = True
                    break
                self._window.append(fetch)
                begun.append(fetch)
                self._issued += 1
                if len(begun) == self._refill:
                    started, begun = begun, []
                    self._fetcher.start(started)
        finally:
            self._fetcher.start(begun)
        return bool(self._window)

    def _begin(self, key: ChunkKey) -> Fetch | Skip:
        direct = None if self._direct is None else (self._direct, self._issued)
        remote = key in self._remote
        fetch = self._fetcher.begin(key, direct, remote, self._spare, self._held)
        while not self._window:  # this window holds nothing: wait, for room or for a read
            if fetch in (Skip.NO_ROOM, Skip.NO_ROOM_BELOW) and self._may_wait:
                fetch = self._after_writes(key, direct, remote, fetch)
                if fetch is Skip.NO_ROOM_BELOW:  # no write to wait for would make room: a
                    fetch = self._fetcher.begin(  # later chunk of its own goes, as it must
                        key, direct, remote, self._spare, self._held, careful=False)
            elif fetch is Skip.BUSY:  # (then, perhaps, for the room its read took)
                fetch = self._after_staging(key, direct, remote)
            else:
                break
        return fetch

    def _after_writes(self, key: ChunkKey, direct: tuple[DirectTarget, int] | None,
                      remote: bool, fetch: Fetch | Skip) -> Fetch | Skip:
        """No host slot is free and this window holds none: every host slot is pinned or
        reserved, by background writes (each pins the host slot it writes from) or by other
        gets copying chunks out and reading them in. Wait for the writes (a write queued
        but not yet handed to the engine counts too: the chunks this get promoted start
        theirs just after their copy), or look again every ``HELD_POLL_S`` for the other
        gets to let go, and begin the chunk again: at most ``drain_timeout`` in all for
        this get, after which no later chunk of it waits (a hung drive)."""
        lane, writes = self._state.lane, self._runner.disk_writes
        if self._wait_until is None:
            self._wait_until = time.monotonic() + self._drain_timeout
        deadline = self._wait_until
        while fetch in (Skip.NO_ROOM, Skip.NO_ROOM_BELOW):
            left = time_left(deadline)
            if not left:
                self._may_wait = False
                break
            if lane.pending() or writes.writes_pending:
                if not lane.drain(timeout=left):
                    self._may_wait = False  # a hung drive: no later chunk waits again
                    break
                if not lane.pending():
                    time.sleep(HELD_POLL_S)  # a write between its queue and the engine
            elif fetch is Skip.NO_ROOM_BELOW:  # the room below is this get's own, or others'
                break  # pins: only a write ends soon for sure
            else:  # other gets hold the slots: they let go once a copy or a read is over
                time.sleep(HELD_POLL_S)
            fetch = self._fetcher.begin(key, direct, remote, self._spare, self._held)
        return fetch

    def _after_staging(self, key: ChunkKey, direct: tuple[DirectTarget, int] | None,
                       remote: bool) -> Fetch | Skip:
        """``key`` is being read into host memory by another ``get``: wait for that read to
        end (at most ``load_timeout`` in all), then begin the chunk again; ``END`` past it."""
        timeout = self._state.config.load_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        fetch: Fetch | Skip = Skip.BUSY
        while fetch is Skip.BUSY and self._fetcher.wait_staged(key, time_left(deadline)):
            fetch = self._fetcher.begin(key, direct, remote, self._spare, self._held)
        return Skip.END if fetch is Skip.BUSY else fetch

    def _copy(self, fetches: list[Fetch], chunks_out: Callable[[int, int], Run]) -> bool:
        """Copy out a run from ``_next_run`` (one chunk unless they are all in memory)."""
        source = self._fetcher.complete(fetches[0])
        if source is None:
            return False
        if source.tier is not DISK:  # else read straight into the caller's tensor
            self._runner.copy(chunks_out(len(self.loaded), len(fetches)),
                              self._state.transfers.run_of(source, len(fetches)))
            # the first from where it completed (a staging slot, for a disk read), the
            # others, all in memory, from where they are pinned
            for fetch, copied_from in zip(fetches, [source] + [f.loc for f in fetches[1:]],
                                          strict=True):
                self._after_copy(fetch, copied_from)
        self.loaded += [fetch.tier for fetch in fetches]
        return True

    def _after_copy(self, fetch: Fetch, source: Location) -> None:
        """A chunk copied out from ``source``: promoted to the top tier, offered to the
        remote store."""
        if source.tier is not self._state.books.top:
            self._runner.promote(fetch.key, source, self._spare)
        remote = self._state.remote
        if remote is not None and source.tier is HOST:  # it may have earned its write
            remote.loaded(fetch.key, source.slot)
            remote.start()

    def _finish(self, held: list, wanted: int) -> None:
        try:
            error: BaseException | None = None
            for fetch in self._window:  # past the end of the prefix: not needed any more
                try:
                    self._fetcher.drop_unused(fetch)
                except BaseException as exc:  # the others are still let go of, each of them
                    error = error or exc
                finally:
                    self._fetcher.release(fetch)
            if error is not None:
                raise error
            self._state.sync()
        finally:
            self._fetcher.unpin(held)
            self._state.books.got(self.loaded, wanted)
