"""The disk lane: a disk tier and everything that runs it, the same for every owner (the
standalone store and the vLLM worker): its I/O engine, the tries of paths out of service,
which paths the owner has been told are down, and failures logged once per kind."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar

import numpy as np

from kvtier.config.settings import Compression, KVTierConfig, ODirect
from kvtier.disk.durable import sync_at_close, sync_path
from kvtier.disk.recovery import RecoveredSlot, RecoveryReport
from kvtier.disk.retry import DiskRetries, OnBack
from kvtier.disk.tier import DiskTier
from kvtier.io.engine import CLOSE_TIMEOUT_S, EngineFactory, IOEngine, IOExecutor
from kvtier.io.guarded import start_thread
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.logs import FailureLog
from kvtier.segment.names import writer_ids

log = logging.getLogger("kvtier")
_O_DIRECT = {ODirect.AUTO: None, ODirect.ON: True, ODirect.OFF: False}

# what each failed outcome counts as, in every owner's statistics
FAILURE_COUNTERS = {IOStatus.CORRUPT: "corruptions", IOStatus.IO_ERROR: "io_errors",
                    IOStatus.NO_SPACE: "no_space", IOStatus.PATH_DOWN: "paths_down",
                    IOStatus.TIMED_OUT: "load_timeouts"}


class DiskLane:
    """A disk tier over ``disk_paths`` and the machinery around it.

    Contract:

    - ``tier`` moves and checks bytes (:class:`DiskTier`); ``submit(queue, job)`` runs a
      blocking I/O job on that queue's threads (one queue per path, and with ``move_lanes``
      a second one per path, ``move_queue_of(slot)``, for moves a caller waits on) and
      returns its ``Future`` at once; ``pending`` and ``drain`` as :class:`IOExecutor`. The
      engine is built by ``engine_factory`` (:class:`IOEngine` unless a test passes its own).
    - ``recover()`` rebuilds what the tier holds from disk (torn slots logged once).
    - ``poll()`` starts the due tries of paths out of service; it does no I/O. A path that
      comes back calls ``on_back(index, found)`` with ``lock`` held, after ``newly_down``
      forgets it: ``found``, what a path out since the start holds (``DiskRetries``).
    - ``newly_down()`` (lock held) returns each path that went out of service since it was
      last reported, once: the owner retires its slots.
    - ``note_failure(result, op)`` logs a failed request once per kind (a path going down is
      logged by the tier, once per path) and returns its counter name (``FAILURE_COUNTERS``).
    - ``sync(index)`` makes what path ``index`` holds durable (blocking: ``KVStore.flush``
      runs it on the path's queue).
    - ``close(timeout)`` waits at most ``timeout`` for jobs; True when all ended and the files
      are synced (``sync_at_close``) and closed. With jobs still running (a hung drive) it
      cancels the queued ones, logs one ERROR and returns False: the files stay open for the
      running ones.
    """

    def __init__(self, tier: DiskTier, engine: IOExecutor, lock: threading.Lock,
                 on_back: OnBack, failures: FailureLog, move_lanes: bool, threads: int = 8) -> None:
        self.tier, self.engine, self.failures = tier, engine, failures
        self._move_lanes, self._on_back = move_lanes, on_back
        self._reported: set[int] = set()
        self._retries = DiskRetries(tier, engine, lock, self._back, threads)

    @classmethod
    def open(cls, config: KVTierConfig, namespace: Namespace, raw_bytes: int, element_bytes: int,
             *, lock: threading.Lock, on_back: OnBack, failures: FailureLog,
             move_lanes: bool = False, engine_factory: EngineFactory = IOEngine,
             writers: Sequence[str] | None = None, parts: Sequence[int] = ()) -> DiskLane:
        """``writers``: the writer ids to try in order (default: ``writer_ids(instance_id)``);
        ``parts``: the sizes of the parts a chunk is checked in (``DiskTier``)."""
        tier = DiskTier(config.disk_paths, namespace, raw_bytes, config.segment_capacity,
                        compression=config.compression is Compression.ZSTD,
                        element_bytes=element_bytes, o_direct=_O_DIRECT[config.o_direct],
                        floor=config.disk_min_free, retry=config.disk_retry,
                        writers=writers or writer_ids(config.instance_id),
                        lease_timeout=config.lease_timeout, share_writers=config.share_writers,
                        parts=parts, answer_timeout=config.load_timeout)
        queues = [*tier.queues, *map(_moves, tier.queues)] if move_lanes else tier.queues
        try:
            engine = engine_factory(queues, config.io_threads)
        except BaseException:
            tier.close()
            raise
        return cls(tier, engine, lock, on_back, failures, move_lanes, config.io_threads)

    @property
    def num_slots(self) -> int:
        return self.tier.num_slots

    @property
    def queues(self) -> list[str]:
        return self.tier.queues

    @property
    def roots(self) -> list[str]:
        return self.tier.roots

    def slots_of_path(self, index: int) -> range:
        return self.tier.slots_of_path(index)

    def queue_of(self, slot: int) -> str:
        return self.tier.queue_of(slot)

    def invalidate(self, slot: int, key: ChunkKey | None = None) -> IOResult:
        return self.tier.invalidate(slot, key)

    def read_many(self, items: Sequence[tuple[int, ChunkKey, np.ndarray]]) -> list[IOResult]:
        """Blocking, verified reads (run them in a job on the slots' queue)."""
        return self.tier.read_many(items)

    def read_parts(self, items: Sequence[tuple[int, ChunkKey, np.ndarray, Sequence[int]]]
                   ) -> list[IOResult]:
        """Blocking, verified reads of some parts of each chunk (``DiskTier.read_parts``)."""
        return self.tier.read_parts(items)

    def write_many(self, items: Sequence[tuple[int, ChunkKey, np.ndarray]],
                   records: Mapping[ChunkKey, bytes] | None = None) -> list[IOResult]:
        """Blocking writes (run them in a job on the slots' queue)."""
        return self.tier.write_many(items, records)

    def note_timeout(self, slot: int) -> bool:
        """A request on ``slot``'s path given up after ``load_timeout``: it counts against the
        path's health. True when that took the path out of service."""
        return self.tier.note_timeout(slot)

    def sync(self, index: int) -> IOResult:
        """Blocking (run it on path ``index``'s queue): make what the path holds durable
        (``kvtier.disk.durable.sync_path``)."""
        return sync_path(self.tier.paths, index)

    def move_queue_of(self, slot: int) -> str:
        queue = self.tier.queue_of(slot)
        return _moves(queue) if self._move_lanes else queue

    def submit(self, queue: str, job: Callable[[], Any]) -> Future:
        return self.engine.submit(queue, job)

    def pending(self, queue: str | None = None) -> int:
        return self.engine.pending(queue)

    def drain(self, timeout: float | None = None) -> bool:
        return self.engine.drain(timeout)

    @property
    def closed(self) -> bool:
        """The engine takes no more jobs."""
        return self.engine.closed

    def recover(self, threads: int) -> RecoveryReport:
        report = self.tier.recover(threads=threads)
        if report.torn:
            self.failures.note("torn slots at start", f"{report.torn} slots with a bad header "
                               "or checksum dropped (a crash mid-write, or damage)")
        return report

    def poll(self) -> None:
        if self._reported:
            self._retries.poll()

    @property
    def down_paths(self) -> dict[int, str]:
        """Paths out of service by index, with the reason."""
        return self.tier.down_paths

    def newly_down(self) -> dict[int, str]:
        down = {i: reason for i, reason in self.tier.down_paths.items() if i not in self._reported}
        self._reported.update(down)
        return down

    def _back(self, index: int, found: list[RecoveredSlot]) -> Callable[[], bool] | None:
        if index not in self._reported:
            return None
        self._reported.discard(index)
        return self._on_back(index, found)

    def note_failure(self, result: IOResult, op: str) -> str | None:
        if result.status is not IOStatus.PATH_DOWN:
            self.failures.note(f"disk {op} {result.status.value}", result.detail)
        return FAILURE_COUNTERS.get(result.status)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Drain and close within ``timeout``, a hung drive or mount included: the jobs,
        then the paths (each in service synced, then their heartbeats end and each lease says
        it closed: writes that a dead mount never answers), on a thread of their own given what is left of
        ``timeout``, ``PATHS_CLOSE_S`` at least (a failed start's ``close(0)`` closes its
        healthy paths all the same). False when either is not over then."""
        ends = time.monotonic() + timeout
        if not self.engine.close(timeout):
            log.error("kvtier disk jobs still running after %g s (a hung drive?): queued "
                      "writes were dropped; host memory and cache files stay open until the "
                      "process exits", timeout)
            return False
        budget = min(max(PATHS_CLOSE_S, ends - time.monotonic()), threading.TIMEOUT_MAX)
        closing = threading.Thread(target=self._close_paths, args=(budget / 2,),
                                   name="kvtier-close", daemon=True)
        if not start_thread(closing):
            log.error("kvtier disk paths not closed: no thread could start to close them")
            return False
        closing.join(budget)
        if closing.is_alive():
            log.error("kvtier disk paths not closed after %g s (a hung mount?): their leases "
                      "do not say so; cache files stay open until the process exits", timeout)
            return False
        return True


    def _close_paths(self, sync_s: float) -> None:
        sync_at_close(self.tier.paths, sync_s)  # before each lease says its segment closed
        self.tier.close()


PATHS_CLOSE_S = 2.0  # the least a lane's close gives its paths' close


def _moves(queue: str) -> str:
    return f"{queue}:moves"


class NoDisk:
    """The lane of a store without ``disk_paths``: no slots, nothing queued, nothing down.

    Its tier holds no slot, so the bookkeeping never plans a disk read or write on it, and
    ``submit`` is never called (it raises if it were)."""

    tier = None
    engine = None
    num_slots = 0
    queues: ClassVar[list[str]] = []
    roots: ClassVar[list[str]] = []
    down_paths: ClassVar[dict[int, str]] = {}

    def slots_of_path(self, index: int) -> range:
        return range(0)

    def note_timeout(self, slot: int) -> bool:
        return False

    def submit(self, queue: str, job: Callable[[], Any]) -> Future:
        raise AssertionError("no disk tier: nothing may be submitted")

    def queue_of(self, slot: int) -> str:
        raise AssertionError("no disk tier: it has no slots")

    def sync(self, index: int) -> IOResult:
        raise AssertionError("no disk tier: it has no paths")

    move_queue_of = queue_of

    def read_many(self, items: Sequence[tuple[int, ChunkKey, np.ndarray]]) -> list[IOResult]:
        raise AssertionError("no disk tier: nothing may be read")

    def read_parts(self, items: Sequence[tuple[int, ChunkKey, np.ndarray, Sequence[int]]]
                   ) -> list[IOResult]:
        raise AssertionError("no disk tier: nothing may be read")

    def write_many(self, items: Sequence[tuple[int, ChunkKey, np.ndarray]],
                   records: Mapping[ChunkKey, bytes] | None = None) -> list[IOResult]:
        raise AssertionError("no disk tier: nothing may be written")

    def invalidate(self, slot: int, key: ChunkKey | None = None) -> IOResult:
        return IOResult(IOStatus.OK)

    def note_failure(self, result: IOResult, op: str) -> str | None:
        return FAILURE_COUNTERS.get(result.status)

    def pending(self, queue: str | None = None) -> int:
        return 0

    def drain(self, timeout: float | None = None) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return True

    def recover(self, threads: int) -> RecoveryReport:
        return RecoveryReport([], 0, 0, 0)

    def poll(self) -> None:
        pass

    def newly_down(self) -> dict[int, str]:
        return {}

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        return True


def open_lane(config: KVTierConfig, namespace: Namespace, raw_bytes: int, element_bytes: int,
              **kwargs: Any) -> DiskLane | NoDisk:
    """The lane for ``config``: a :class:`DiskLane` over its ``disk_paths``, or :class:`NoDisk`."""
    if not config.disk_paths:
        return NoDisk()
    return DiskLane.open(config, namespace, raw_bytes, element_bytes, **kwargs)
