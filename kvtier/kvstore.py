"""``KVStore``: the tiered store in one process, for use without a serving engine.

    store = KVStore(KVLayout(num_layers=32, kv_heads=8, head_size=128), {"host_capacity": "8GiB"},
                    model="meta-llama/Llama-3.1-8B")
    store.put(tokens, kv)                 # kv: (layers, 2, len(tokens), kv_heads * head_size)
    hit = store.lookup(tokens)            # hit.tokens cached, hit.chunks_by_tier
    n = store.get(tokens, out)            # fills out[:, :, :n] and returns n

Bookkeeping runs under one lock; bytes move outside it, so puts and gets from many threads
overlap. Disk writes run in the background on the I/O engine; disk reads of one ``get`` run
in parallel.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Any

import numpy as np
import torch

from kvtier.config import KVTierConfig, WritePolicy, load_config
from kvtier.errors import ConfigError, LayoutError, StoreClosedError
from kvtier.io.buffers import align_up
from kvtier.io.engine import CLOSE_TIMEOUT_S, IOEngine
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey, token_chunk_keys
from kvtier.layout import DTYPE_BYTES, KVLayout
from kvtier.metrics import MetricsServer, Sample, serve_metrics
from kvtier.stats import FailureLog, StoreStats, store_samples
from kvtier.tier_stack import Location, Move, StorePlan, TierStack
from kvtier.tiers.base import MemoryTier, TierName
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_lane import DiskLane, NoDisk, open_lane
from kvtier.tiers.gpu import DevicePool
from kvtier.tiers.host import make_host_tier
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.policy import make_policy
from kvtier.transfers import Transfers

Tokens = Sequence[int] | np.ndarray
GPU, HOST, DISK = TierName.GPU, TierName.HOST, TierName.DISK
log = logging.getLogger("kvtier")


@dataclass
class _Fetch:
    """One chunk of a ``get``: where it is pinned, and its disk read into host if any."""

    key: ChunkKey
    loc: Location
    read: Future | None = None
    plan: StorePlan | None = None  # the host slot the read fills
    staged: Location | None = None  # that slot once the read checked out (pinned)
    deadline: float | None = None  # time.monotonic() by which the read must be over
    given_up: bool = False  # not over by its deadline, or not needed any more


class _Skip(Enum):
    """Why a chunk was not planned (``put``) or fetched (``get``)."""

    PRESENT = "present"  # put: cached already, or being written
    NO_ROOM = "no room"  # no slot free now
    END = "end"  # get: not cached, or its staging slot could not be written back in time


@dataclass(frozen=True)
class FlushResult:
    """What ``flush`` did: chunks it wrote, host chunks still not on disk when it returned,
    and whether it stopped at its timeout. True when every host chunk is on disk."""

    written: int
    not_written: int
    timed_out: bool = False

    def __bool__(self) -> bool:
        return self.not_written == 0 and not self.timed_out


@dataclass(frozen=True)
class PrefixHit:
    """How much of a token sequence is cached: ``tokens`` (whole chunks) and where."""

    tokens: int
    chunks_by_tier: Mapping[TierName, int] = field(default_factory=dict)


class KVStore:
    """A tiered KV store: device pool (``gpu_capacity``), host memory (``host_capacity``),
    then disk (``disk_paths``, ``disk_capacity``).

    Chunks of ``chunk_tokens`` tokens are keyed by their whole prefix, placed in the hottest
    tier, moved down a tier when evicted, and promoted to the hottest tier when read. With
    ``write_through`` every chunk that reaches host memory is also written to disk in the
    background (dropped, and counted, when the disk queue is full); with ``write_back`` a
    chunk is written when host memory evicts it. Chunks on disk survive restarts.
    """

    def __init__(self, layout: KVLayout, config: KVTierConfig | Mapping[str, Any] | None = None,
                 *, model: str | None = None, device: torch.device | str | None = None) -> None:
        self.config = cfg = config if isinstance(config, KVTierConfig) else load_config(config)
        self.layout = layout
        self.chunk_tokens = cfg.chunk_tokens
        self.namespace = layout.namespace(_model_name(model, cfg), self.chunk_tokens)
        self.chunk_bytes = layout.token_bytes * self.chunk_tokens
        self.slot_bytes = align_up(self.chunk_bytes)
        self._lock = threading.Lock()
        self._stats = StoreStats()
        self._failures = FailureLog()
        self.tiers: dict[TierName, MemoryTier] = {}
        self._lane: DiskLane | NoDisk = NoDisk()
        self._metrics: MetricsServer | None = None
        self._closed = False
        try:  # a failed start must not keep memory, files or the namespace lock
            self._start(device)
        except BaseException:
            self._release_all()
            raise

    def _start(self, device: torch.device | str | None) -> None:
        cfg = self.config
        if cfg.gpu_capacity >= self.slot_bytes:
            self.tiers[GPU] = DevicePool(cfg.gpu_capacity // self.slot_bytes, self.slot_bytes, device)
        if cfg.host_capacity >= self.slot_bytes:
            self.tiers[HOST] = make_host_tier(cfg.host_capacity, self.slot_bytes)
        self._check_tiers()
        # write-back moves get their own queue per path: a put or get waiting on one must not
        # queue behind background writes and read-ahead
        self._lane = open_lane(cfg, self.namespace, self.chunk_bytes, DTYPE_BYTES[self.layout.dtype],
                               lock=self._lock, on_back=self._path_back, failures=self._failures,
                               move_lanes=True)
        policy = cfg.eviction_policy
        levels = [(name, SlotIndex(t.num_slots, make_policy(policy))) for name, t in self.tiers.items()]
        levels.append((DISK, SlotIndex(self._lane.num_slots, make_policy(policy))))  # 0 without disk
        self._stack = TierStack(levels)
        self._top = self._stack.order[0]
        self._transfers = Transfers(self.tiers, self._lane.tier, self.chunk_bytes,
                                    getattr(torch, self.layout.dtype),
                                    self.layout.shape(self.chunk_tokens))
        self._max_pending = 4 * cfg.io_threads
        self._recover()
        if cfg.metrics_port:
            self._metrics = serve_metrics(cfg.metrics_port, self.metric_samples)
        host_slots = self.tiers[HOST].num_slots if HOST in self.tiers else 2
        self._read_ahead = max(1, min(2 * cfg.io_threads, host_slots // 2))

    def _check_tiers(self) -> None:
        if HOST not in self.tiers and (self.config.disk_paths or not self.tiers):
            raise ConfigError(
                f"kvtier config: host_capacity={self.config.host_capacity} holds no chunk of "
                f"{self.chunk_bytes} bytes ({self.chunk_tokens} tokens), and the disk tier and "
                "the store need at least one; raise host_capacity or lower chunk_tokens"
            )

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier (None without ``disk_paths``), for inspection."""
        return self._lane.tier

    @property
    def _engine(self) -> IOEngine | None:
        return self._lane.engine

    def _recover(self) -> None:
        report = self._lane.recover(threads=self.config.io_threads)
        index = self._stack.indexes[DISK]
        for found in sorted(report.slots, key=lambda r: r.header.generation):  # oldest evicts first
            index.adopt(found.header.key, found.slot)
        self._stats.recovered_chunks = len(index)
        self._stats.torn_slots = report.torn
        self._retire_down_paths()

    def _release_all(self) -> None:
        """Give back what a start that failed had taken (nothing is running yet)."""
        if self._metrics is not None:
            self._metrics.close()
        self._lane.close(0)
        for tier in self.tiers.values():
            tier.close()

    # -- public API ---------------------------------------------------------------------

    def keys(self, tokens: Tokens) -> list[ChunkKey]:
        """Chunk keys of the full chunks of ``tokens`` (``TokenError`` unless they are
        integers in int64's range)."""
        if self._closed:
            raise StoreClosedError("kvtier store is closed; open a new KVStore")
        return token_chunk_keys(self.namespace, tokens)

    def put(self, tokens: Tokens, kv: torch.Tensor) -> int:
        """Store the KV of every full chunk of ``tokens``; return the tokens newly stored.

        ``kv`` has shape ``(layers, 2, n, kv_heads * head_size)`` with ``n >= len(tokens)``
        rounded down to whole chunks. Chunks already cached are only marked recent.
        """
        keys = self.keys(tokens)
        self._check_tensor(kv, len(keys) * self.chunk_tokens, "kv")
        self._lane.poll()
        stored, may_wait = 0, True
        for i, key in enumerate(keys):
            plan = self._plan_put(key)
            if plan is _Skip.NO_ROOM and may_wait and self._lane.pending():
                # Slots held by background writes: wait for them once (not for long if the
                # disk is hung), then try again.
                may_wait = self._lane.drain(timeout=self._drain_timeout())
                plan = self._plan_put(key)
            if not isinstance(plan, StorePlan):
                self._count("chunks_skipped")
                continue
            stored += self._write(plan, partial(self._copy_in, self._chunk_of(kv, i)))
        with self._lock:
            self._stats.chunks_stored += stored
        return stored * self.chunk_tokens

    def _copy_in(self, chunk: torch.Tensor, dst: Location) -> None:
        self._transfers.view(dst).copy_(chunk)

    def _plan_put(self, key: ChunkKey) -> StorePlan | _Skip:
        """A plan to store ``key``, or why there is none."""
        with self._lock:
            if self._stack.locate(key) is not None or self._stack.indexes[self._top].has_entry(key):
                self._stack.touch(key)
                return _Skip.PRESENT
            return self._stack.plan_store(key, self._top) or _Skip.NO_ROOM

    def _drain_timeout(self) -> float:
        timeout = self.config.load_timeout
        return 30.0 if timeout is None else min(30.0, timeout)

    def lookup(self, tokens: Tokens) -> PrefixHit:
        """The longest cached prefix of ``tokens``, in tokens, and its chunks per tier."""
        keys = self.keys(tokens)
        with self._lock:
            match = self._stack.match_prefix(keys)
        counts = Counter(loc.tier for loc in match.locations)
        return PrefixHit(match.num_chunks * self.chunk_tokens, dict(counts))

    def get(self, tokens: Tokens, out: torch.Tensor) -> int:
        """Copy the longest cached prefix of ``tokens`` into ``out``; return its length.

        ``out`` has shape ``(layers, 2, m, kv_heads * head_size)``; at most ``m`` tokens
        (whole chunks) are loaded into ``out[:, :, :n]``. Disk chunks are read in parallel
        and verified; a chunk that fails its check ends the prefix there and is dropped.
        Chunks read from a colder tier are promoted to the hottest one.
        """
        keys = self.keys(tokens)
        self._check_tensor(out, 0, "out")
        keys = keys[: out.shape[2] // self.chunk_tokens]
        window: deque[_Fetch] = deque()  # chunks pinned, their disk reads in flight
        loaded: list[TierName] = []
        issued, ended = 0, False
        held = self._hold_disk_chunks(keys)
        may_wait = True
        try:
            while True:
                while not ended and issued < len(keys) and len(window) < self._read_ahead:
                    fetch = self._begin_fetch(keys[issued])
                    if fetch is _Skip.NO_ROOM and not window and may_wait and self._lane.pending():
                        # host slots held by background writes: wait for them once
                        may_wait = self._lane.drain(timeout=self._drain_timeout())
                        fetch = self._begin_fetch(keys[issued])
                    if fetch is _Skip.NO_ROOM and window:
                        break  # host slots held by this window: complete one first
                    if not isinstance(fetch, _Fetch):
                        ended = True
                        break
                    window.append(fetch)
                    issued += 1
                if not window:
                    break
                fetch = window.popleft()
                try:
                    source = self._complete_fetch(fetch)
                    if source is None:
                        ended = True
                        break
                    self._chunk_of(out, len(loaded)).copy_(self._transfers.view(source))
                    if source.tier is not self._top:
                        self._promote(fetch.key, source)
                    loaded.append(fetch.loc.tier)
                finally:
                    self._release(fetch)
        finally:
            try:
                for fetch in window:  # past the end of the prefix: not needed any more
                    try:
                        self._drop_unused(fetch)
                    finally:
                        self._release(fetch)
                self._sync()
            finally:
                self._unpin(held)
                with self._lock:
                    self._stats.chunks_loaded.update(loaded)
                    self._stats.chunks_missed += len(keys) - len(loaded)
        return len(loaded) * self.chunk_tokens

    def _hold_disk_chunks(self, keys: list[ChunkKey]) -> list[tuple[ChunkKey, Location]]:
        """Pin the disk chunks of the cached prefix of ``keys`` for a whole ``get``: making
        room in host memory for one read demotes host chunks to disk, which must not evict
        a later chunk of the same prefix."""
        with self._lock:
            return self._stack.pin_prefix(keys, DISK)

    def flush(self, timeout: float | None = None) -> FlushResult:
        """Write every chunk held in host memory that is not on disk yet (write-through
        writes dropped under back-pressure included, and write-back chunks not evicted yet),
        then wait for every disk write, at most ``timeout`` seconds. True when every host
        chunk is on disk; ``not_written`` says how many are not (disk full or failing, a
        hung drive, or no disk tier)."""
        if self._closed:
            raise StoreClosedError("kvtier store is closed; open a new KVStore")
        if not self._lane.num_slots:
            return FlushResult(0, 0)  # no disk tier: nothing to write to
        deadline = None if timeout is None else time.monotonic() + timeout
        written, batch = 0, self._max_pending * len(self._lane.queues)
        tried: set[ChunkKey] = set()
        started: list[Future] = []
        while True:  # a batch at a time, so that puts meanwhile still find host slots free
            drained = self._lane.drain(self._time_left(deadline))  # writes in flight first
            written += sum(1 for f in started if f.done() and not f.cancelled() and f.result())
            if not drained:
                break
            with self._lock:
                todo = [item for item in self._host_only() if item[0] not in tried][:batch]
                tried.update(key for key, _ in todo)
                started = [f for f in map(self._flush_one, todo) if f is not None]
            if not todo:
                break
        with self._lock:
            left = len(self._host_only())
        return FlushResult(written, left, timed_out=not drained)

    def _host_only(self) -> list[tuple[ChunkKey, int]]:
        """(key, host slot) of host chunks with no disk copy and none being written (lock held)."""
        host, disk = self._stack.indexes[HOST], self._stack.indexes[DISK]
        found, visible = [], host.keys()
        for key in visible:
            slot = host.slot_of(key)
            if slot is not None and not disk.has_entry(key):
                found.append((key, slot))
        return found

    def _flush_one(self, item: tuple[ChunkKey, int]) -> Future | None:
        """Start the disk write of one host chunk (lock held); None when the disk has no room."""
        return self._start_disk_write(*item)

    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        with self._lock:
            self._stats.evictions = {str(n): i.evictions for n, i in self._tiers_in_use()}
            self._stats.demotions, self._stats.drops = self._stack.demotions, self._stack.drops
            return self._stats.snapshot()

    def _tiers_in_use(self) -> list[tuple[TierName, SlotIndex]]:
        """The tiers' indexes, without the empty disk level of a store without disk_paths."""
        return [(name, index) for name, index in self._stack.indexes.items()
                if name is not DISK or self.config.disk_paths]

    def metric_samples(self) -> list[Sample]:
        """The store's metrics (what ``metrics_port`` serves)."""
        stats = self.stats()
        with self._lock:
            used = {str(name): len(index) for name, index in self._tiers_in_use()}
            slots = {str(name): index.num_slots for name, index in self._tiers_in_use()}
        return store_samples(stats, slots, used, self._lane.pending())

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Finish background writes and release memory, files and threads; True when done.

        Waits at most ``timeout`` seconds for disk jobs. Jobs still running then (a hung
        drive) are left behind: queued ones are cancelled, and the host memory and disk files
        the running ones use stay open until the process exits (False is returned).
        """
        self._closed = True  # no call is served from now on
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if not self._lane.close(timeout):  # a hung drive: its I/O still uses host memory
            return False
        for tier in self.tiers.values():
            tier.close()
        return True

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writes -------------------------------------------------------------------------

    def _write(self, plan: StorePlan, fill: Callable[[Location], object]) -> bool:
        """Run the plan's demotions, then ``fill(dst)``; finish every reservation."""
        if not self._demote(plan):
            return False
        ok = False
        try:
            fill(plan.dst)
            self._sync()
            ok = True
        finally:
            self._finish(plan.key, plan.dst, ok)
        return ok

    def _demote(self, plan: StorePlan) -> bool:
        """Run the plan's demotions, deepest first. False when a write to disk is not over
        by ``load_timeout`` (a hung drive): the later moves and the plan itself then fail,
        and their slots stay reserved until that write ends, as it still reads from them."""
        for i, move in enumerate(plan.demotions):
            try:
                hung = self._move(move)
            except BaseException:
                self._fail_reservations(plan, i + 1)
                raise
            if hung is not None:
                hung.add_done_callback(partial(self._fail_reservations, plan, i + 1))
                return False
        return True

    def _fail_reservations(self, plan: StorePlan, first_move: int, _: Future | None = None) -> None:
        with self._lock:
            for move in plan.demotions[first_move:]:
                self._stack.finish(move.key, move.dst, False)
            self._stack.finish(plan.key, plan.dst, False)

    def _move(self, move: Move) -> Future | None:
        """Copy one chunk down a tier and finish its reservation. A write to disk runs on the
        I/O engine; one not over by ``load_timeout`` is left running and returned: it is
        counted and logged, and its reservation is finished when it ends."""
        if move.dst.tier is not DISK:
            result = IOResult(IOStatus.IO_ERROR, detail="move did not run")
            try:
                result = self._transfers.copy(move.key, move.src, move.dst)
                self._sync()
            finally:
                self._finish(move.key, move.dst, result.ok)
            return None
        try:
            write = self._lane.submit(self._lane.move_queue_of(move.dst.slot),
                                      partial(self._transfers.copy, move.key, move.src, move.dst))
        except BaseException:  # the engine is closed: nothing runs
            self._finish(move.key, move.dst, False)
            raise
        try:
            result = write.result(timeout=self.config.load_timeout)
        except TimeoutError:
            return self._left_running(move, write)
        except Exception as exc:  # the copy raised: a failed write, never a crash
            result = IOResult(IOStatus.IO_ERROR, detail=repr(exc))
        self._moved(move, result)
        return None

    def _left_running(self, move: Move, write: Future) -> Future:
        """A write-back past ``load_timeout``: counted, logged once, and finished when it ends."""
        self._timed_out(move.dst.slot, "disk write-back timed_out", f"a chunk moving to disk got "
                        f"no answer after {self.config.load_timeout:g} s (load_timeout); the put "
                        "or get that needed its host slot went on without it")
        write.add_done_callback(lambda f: self._moved(move, _result_of(f)))
        return write

    def _moved(self, move: Move, result: IOResult) -> None:
        self._finish(move.key, move.dst, result.ok)
        with self._lock:
            self._account_write(result)

    def _finish(self, key: ChunkKey, dst: Location, ok: bool) -> None:
        with self._lock:
            self._stack.finish(key, dst, ok)
            if ok and dst.tier is HOST:
                self._write_through(key, dst.slot)

    def _write_through(self, key: ChunkKey, host_slot: int) -> None:
        """Start a background disk write of a chunk that just reached host (lock held);
        dropped when the disk queue is full (``flush`` writes it later)."""
        if self.config.write_policy is not WritePolicy.WRITE_THROUGH:
            return
        if not self._stack.indexes[DISK].has_entry(key):
            self._start_disk_write(key, host_slot, may_drop=True)

    def _start_disk_write(self, key: ChunkKey, host_slot: int, may_drop: bool = False) -> Future | None:
        """Reserve a disk slot for a host chunk and queue its write (lock held); None when
        there is no room, or the queue is full and ``may_drop``."""
        plan = self._stack.plan_store(key, DISK)
        if plan is None:
            return None
        queue = self._lane.queue_of(plan.dst.slot)
        if may_drop and self._lane.pending(queue) >= self._max_pending:
            self._stack.finish(key, plan.dst, False)
            self._stats.dropped_writes += 1
            self._failures.note("write-through dropped", "the disk write queue is full; "
                                "chunks stay in host memory until flush() or eviction "
                                "writes them (counted in dropped_writes)")
            return None
        src = Location(HOST, host_slot)
        self._stack.indexes[HOST].pin(key)
        return self._lane.submit(queue, lambda: self._background_write(key, src, plan.dst))

    def _background_write(self, key: ChunkKey, src: Location, dst: Location) -> bool:
        result = IOResult(IOStatus.IO_ERROR, detail="write did not run")
        try:
            result = self._transfers.copy(key, src, dst)
        finally:
            with self._lock:
                self._stack.finish(key, dst, result.ok)
                self._stack.unpin(key, src)
                self._account_write(result)
        return result.ok

    def _promote(self, key: ChunkKey, source: Location) -> None:
        with self._lock:
            plan = self._stack.plan_store(key, self._top)
        if plan is not None and self._write(plan, partial(self._copy_in, self._transfers.view(source))):
            self._count("chunks_promoted")

    # -- disk reads ---------------------------------------------------------------------

    def _begin_fetch(self, key: ChunkKey) -> _Fetch | _Skip:
        """Pin ``key`` where it is hottest; from disk, reserve a host slot and start the read.

        ``END`` when the key is not cached or its host slot's previous chunk could not be
        written back in time (a hung drive), ``NO_ROOM`` when no host slot is free for it.
        """
        with self._lock:
            loc = self._stack.locate(key)
            if loc is None:
                return _Skip.END
            self._stack.indexes[loc.tier].pin(key)
            if loc.tier is not DISK:
                return _Fetch(key, loc)
            plan = self._stack.plan_store(key, HOST)
            if plan is None:
                self._stack.unpin(key, loc)
                return _Skip.NO_ROOM
        if not self._demote(plan):  # a hung drive: end the prefix here, the chunk stays cached
            with self._lock:
                self._stack.unpin(key, loc)
            return _Skip.END
        job = partial(self._transfers.copy, key, loc, plan.dst)
        timeout = self.config.load_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        return _Fetch(key, loc, self._lane.submit(self._lane.queue_of(loc.slot), job), plan,
                      deadline=deadline)

    def _complete_fetch(self, fetch: _Fetch) -> Location | None:
        """Where the chunk can be copied from, or ``None`` when its disk read failed or was
        not over by its deadline (``load_timeout`` after it was started).

        A successful read makes the host copy visible and pins it for the fetch; a failed
        one drops the disk copy (and blanks a corrupt slot's header).
        """
        if fetch.given_up:
            return None
        if fetch.read is None or fetch.staged is not None:
            return fetch.staged or fetch.loc
        try:
            result = fetch.read.result(timeout=self._time_left(fetch.deadline))
        except TimeoutError:
            self._give_up(fetch, timed_out=True)
            return None
        except Exception as exc:  # a bug or an unexpected error: a miss, never a crash
            result = IOResult(IOStatus.IO_ERROR, detail=repr(exc))
        fetch.read, plan = None, fetch.plan
        assert plan is not None, "a disk read always fills a reserved host slot"
        with self._lock:
            self._stack.finish(fetch.key, plan.dst, result.ok)
            if result.ok:
                self._stats.disk_reads += 1
                self._stats.disk_read_bytes += result.nbytes
                self._stack.indexes[HOST].pin(fetch.key)
                fetch.staged = plan.dst
                return fetch.staged
            self._stack.discard(fetch.key)
            self._account_failure(result, "read")
        if result.status is IOStatus.CORRUPT:
            self._lane.invalidate(fetch.loc.slot)  # still pinned by us: nobody reuses it meanwhile
        return None

    @staticmethod
    def _time_left(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _drop_unused(self, fetch: _Fetch) -> None:
        """A fetch past the end of the prefix: keep what already arrived, else let go of the
        read without waiting (its slot is freed when it ends; the chunk stays cached)."""
        if fetch.read is not None and not fetch.read.done():
            self._give_up(fetch, timed_out=False)
        else:
            self._complete_fetch(fetch)

    def _give_up(self, fetch: _Fetch, timed_out: bool) -> None:
        """Stop waiting for a fetch's read. Its host slot stays reserved until the read
        ends, since the read may still write into it. A read past its deadline (a hung disk)
        also drops the chunk, counts, and counts against its path's health."""
        read, plan, fetch.read, fetch.given_up = fetch.read, fetch.plan, None, True
        assert read is not None and plan is not None, "only a disk read in flight is given up"
        if timed_out:
            with self._lock:
                self._stack.discard(fetch.key)
            self._timed_out(fetch.loc.slot, "disk read timed_out", f"no answer from disk after "
                            f"{self.config.load_timeout:g} s (load_timeout)")

        def ended(_: Future) -> None:
            with self._lock:
                self._stack.finish(plan.key, plan.dst, False)

        read.add_done_callback(ended)

    def _timed_out(self, slot: int, kind: str, detail: str) -> None:
        """Count (``load_timeouts``) and log once an I/O given up on after ``load_timeout``;
        it counts against its path's health too."""
        went_down = self._lane.note_timeout(slot)
        with self._lock:
            self._stats.load_timeouts += 1
            self._failures.note(kind, detail)
            if went_down:
                self._retire_down_paths()

    def _release(self, fetch: _Fetch) -> None:
        with self._lock:
            self._stack.unpin(fetch.key, fetch.loc)
            if fetch.staged is not None:
                self._stack.unpin(fetch.key, fetch.staged)

    # -- accounting ---------------------------------------------------------------------

    def _account_write(self, result: IOResult) -> None:
        if result.ok:
            self._stats.disk_writes += 1
            self._stats.disk_write_bytes += result.nbytes
        else:
            self._account_failure(result, "write")

    def _account_failure(self, result: IOResult, op: str) -> None:
        """Count and log (once per kind) a failed disk request (lock held)."""
        counter = self._lane.note_failure(result, op)
        if result.status is IOStatus.PATH_DOWN:
            self._retire_down_paths()  # the disk tier logged it, once per path
        elif counter is not None:
            setattr(self._stats, counter, getattr(self._stats, counter) + 1)

    def _path_back(self, index: int) -> None:
        """A disk path came back into service, empty (lock held)."""
        self._stats.paths_back += 1
        self._stats.paths_down.pop(self._lane.roots[index], None)
        self._stack.indexes[DISK].unretire(self._lane.slots_of_path(index))

    def _retire_down_paths(self) -> None:
        """Take the slots of paths that went out of service away from the index (lock held)."""
        for index, reason in self._lane.newly_down().items():
            self._stats.paths_down[self._lane.roots[index]] = reason
            self._stack.indexes[DISK].retire(self._lane.slots_of_path(index))

    def _unpin(self, held: list[tuple[ChunkKey, Location]]) -> None:
        with self._lock:
            for key, loc in held:
                self._stack.unpin(key, loc)

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self._stats, name, getattr(self._stats, name) + 1)

    # -- helpers ------------------------------------------------------------------------

    def _chunk_of(self, kv: torch.Tensor, i: int) -> torch.Tensor:
        return kv[:, :, i * self.chunk_tokens:(i + 1) * self.chunk_tokens]

    def _sync(self) -> None:
        gpu = self.tiers.get(GPU)
        if gpu is not None and gpu.device.type == "cuda":
            torch.cuda.synchronize(gpu.device)

    def _check_tensor(self, kv: torch.Tensor, min_tokens: int, what: str) -> None:
        want = self.layout.shape(min_tokens)
        if (kv.dim() != 4 or kv.shape[:2] != want[:2] or kv.shape[3] != want[3]
                or kv.shape[2] < min_tokens or kv.dtype != getattr(torch, self.layout.dtype)):
            raise LayoutError(
                f"{what} must be a {self.layout.dtype} tensor of shape (layers={want[0]}, 2, "
                f"tokens>={min_tokens}, hidden={want[3]}), got {kv.dtype} {tuple(kv.shape)}"
            )


def _model_name(model: str | None, cfg: KVTierConfig) -> str:
    name = model if model is not None else cfg.model
    if not name or not isinstance(name, str):
        raise ConfigError(
            "kvtier KVStore: no model name: pass KVStore(layout, config, model='org/name') or "
            "set the 'model' config key; it keeps apart the KV of models with the same layout"
        )
    return name


def _result_of(write: Future) -> IOResult:
    try:
        return write.result()
    except BaseException as exc:  # cancelled at close, or an unexpected error
        return IOResult(IOStatus.IO_ERROR, detail=repr(exc))
