"""The connector's worker side: moves bytes as the scheduler side planned.

One per model-runner process (TP rank). It owns the host slots and this rank's disk files,
copies pages between vLLM's paged cache and host slots, drives disk reads and writes, and
reports every outcome back (``WorkerReport``), finished loads (``get_finished``) and the
blocks of chunks that failed to load (so vLLM recomputes them).
"""

from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import wait as wait_futures

import torch

from kvtier.config.settings import KVTierConfig
from kvtier.connector.common.engine_writer import rank_writer_ids
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import RequestLoad, StepPlan, WorkerReport
from kvtier.connector.worker.counters import WorkerCounters
from kvtier.connector.worker.disk import WorkerDisk
from kvtier.connector.worker.ledger import WorkerLedger
from kvtier.connector.worker.load_copy import LoadCopy, copy_into_pages
from kvtier.connector.worker.load_tracker import (
    LoadTracker,
    ReadGate,
    Reads,
    ReadyLoad,
    failed_read,
    resolved,
)
from kvtier.connector.worker.pages import PagedKV, in_chunk_order
from kvtier.connector.worker.remote import WorkerRemote
from kvtier.connector.worker.saves import WorkerSaves
from kvtier.connector.worker.verify import WorkerVerify
from kvtier.disk.lane import DiskLane, NoDisk, open_lane
from kvtier.disk.tier import DiskTier
from kvtier.io.buffers import align_up
from kvtier.io.engine import CLOSE_TIMEOUT_S, EngineFactory, IOEngine
from kvtier.io.guarded import started_pool
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import Namespace
from kvtier.metrics import Sample
from kvtier.shared.reads import OtherReads, other_reads
from kvtier.tiers.host import HostTier, make_host_tier

log = logging.getLogger("kvtier")
SWITCH_INTERVAL_S = 0.0005


class WorkerSide:
    """Carries out each step's ``StepPlan`` on one rank and reports what came of it.

    Contract:

    - ``register(kv_caches)`` comes first: host slots and this rank's disk files are made.
    - ``start_loads(plan)`` before the forward: host loads are copied into the paged cache
      now; loads with disk chunks start their reads and end in a later step's
      ``finished()`` (or, past ``load_timeout``, are given up and recomputed).
    - ``save(plan)`` after the forward: write-back demotions, then pages -> host slots,
      then write-through disk writes and remote writes in the background.
    - Nothing raises into vLLM's step: a failure becomes blocks to recompute
      (``take_invalid_blocks``) and failed chunks in ``report()``.
    - ``close(timeout)`` is bounded even with a hung drive.
    - ``io_engine`` builds the disk lane's I/O engine (tests pass one that holds or fails jobs).
    """

    def __init__(self, config: KVTierConfig, geometry: KVGeometry, namespace: Namespace,
                 *, io_engine: EngineFactory = IOEngine, leader: Namespace | None = None) -> None:
        self.config, self.geometry, self.namespace = config, geometry, namespace
        self._leader = leader  # rank 0's namespace, for a rank > 0 (its writer id comes first)
        self.pages: PagedKV | None = None
        self.host: HostTier | None = None
        self._io_engine = io_engine
        self._lane: DiskLane | NoDisk = NoDisk()
        self._other_reads: OtherReads | None = None
        self._disk: WorkerDisk  # made in register(), with the lane and the host slots
        self._remote: WorkerRemote | None = None  # made in register() too
        self._saves: WorkerSaves | None = None
        self._verify: WorkerVerify | None = None
        self._loader = started_pool(2, "kvtier-load")  # none to start later, in a step
        self._ledger = WorkerLedger()
        self._lock = self._ledger.lock
        self._loads = LoadTracker(config.load_timeout)
        self._unfilled = 0  # steps whose stores all fail: a sync load left blocks unfilled

    @property
    def disk(self) -> DiskTier | None:
        """This rank's disk tier (None without ``disk_paths``), for inspection."""
        return self._lane.tier

    def _attached(self) -> tuple[PagedKV, HostTier]:
        assert self.pages is not None and self.host is not None, "register() comes first"
        return self.pages, self.host

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's KV tensors and allocate the host slots and disk files."""
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            # The engine loop is a busy Python thread: without this, every disk thread waits
            # up to 5 ms for the GIL each time one of its reads returns.
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.pages = PagedKV(in_chunk_order(kv_caches, self.geometry), self.geometry)
        slot_bytes = align_up(self.geometry.chunk_bytes)
        self.host = make_host_tier(self.config.host_capacity, slot_bytes)
        element_bytes = next(iter(kv_caches.values())).element_size()
        self._lane = open_lane(self.config, self.namespace, self.geometry.chunk_bytes,
                               element_bytes, lock=self._lock, on_back=self._ledger.path_back,
                               failures=self._ledger.failures, engine_factory=self._io_engine,
                               writers=rank_writer_ids(self.config, self.namespace,
                                                        self._leader),
                               parts=self.geometry.part_bytes)
        self._ledger.lane = self._lane
        self._other_reads = other_reads(self.config, self.namespace, self.geometry.chunk_bytes,
                                      self._lane)
        self._disk = WorkerDisk(self._lane, self.host, self._ledger, self.config.io_threads,
                                self._other_reads, self.namespace.tp_rank)
        self._remote = WorkerRemote(self.config, self.namespace, self.geometry.chunk_bytes,
                                    self.host, self._ledger, parts=self.geometry.part_bytes)
        self._remote.records = self._disk.record
        self._saves = WorkerSaves(self.pages, self.host, self._lane, self._other_reads, self._disk,
                                  self._remote, self._ledger, self.geometry.chunk_bytes,
                                  self.config.load_timeout)
        self._verify = WorkerVerify.of(self.config, self.geometry, self.pages, self.host,
                                       self._ledger, self._lane, self._submit_reads)
        self._lane.recover(threads=self.config.io_threads)
        with self._lock:
            self._ledger.note_down_paths()  # logged by the tier
        log.info("kvtier worker: %d host slots of %d bytes, disk %s", self.host.num_slots,
                 slot_bytes, f"{self._lane.num_slots} slots" if self._lane.num_slots else "off")

    # -- loads --------------------------------------------------------------------------

    def start_loads(self, meta: StepPlan) -> None:
        """Loads from host memory run now (vLLM calls this before the forward that needs
        them; one left unfilled fails the stores of this step and the next); the others
        start their reads."""
        for load in meta.loads:
            started = time.perf_counter()
            try:
                if not load.asynchronous:
                    if not self._complete(load, {}, started):
                        self._unfilled = 2  # this step's and the next's (``WorkerSaves.save``)
                elif load.demotions:  # write-back victims must leave the staging slots first
                    gate, mark = ReadGate(), self._attached()[0].mark()  # (before the reads)
                    self._loads.add(load, self._disk.demote_then_read(
                        load, gate, self._submit_reads, self._loader), started, gate, mark)
                else:  # its copies into pages, later, wait for what came before (``mark``)
                    mark = self._attached()[0].mark()
                    self._loads.add(load, resolved(self._submit_reads(load)), started, after=mark)
            except Exception as exc:  # never take the step down: the blocks are recomputed
                self._ledger.unexpected("load could not start", load.req_id, exc)
                self._complete(load, {c.key: failed_read(repr(exc)) for c in load.chunks},
                               started)
                self._unfilled = 2  # this step's and the next's (``WorkerSaves.save``)

    def _finish_ready_loads(self) -> None:
        """Complete the asynchronous loads whose disk reads are all over, or whose time
        (``load_timeout``) is up (this thread)."""
        for ready in self._loads.ready(time.perf_counter()):
            if ready.error is not None:
                self._ledger.unexpected("disk reads could not start", ready.load.req_id,
                                        ready.error)
            if ready.late:
                self._note_late(ready)
            self._complete(ready.load, ready.reads, ready.started, not ready.late, ready.after)
        ended = self._loads.released()
        if ended:  # the given-up reads that ended: their staging slots may be reused
            with self._lock:
                self._ledger.pending.reads_over.update(key for key, _, _ in ended)
            for _, result, remote in ended:  # what the late reads came to (a path may be down)
                if not result.ok:
                    self._note_read_failure(remote, result)

    def _note_late(self, ready: ReadyLoad) -> None:
        """Reads given up on count against their paths' health, once a load and path (one
        slow answer, not one per chunk); their slots stay taken."""
        one_each = {self._lane.queue_of(slot): slot for slot in ready.late_slots}
        went_down = [self._lane.note_timeout(slot) for slot in one_each.values()]
        with self._lock:
            self._ledger.pending.reads_stalled.update(ready.late)
            if any(went_down):
                self._ledger.note_down_paths()

    def _complete(self, load: RequestLoad, reads: Reads, started: float,
                  timed: bool = True, after: object = None) -> bool:
        """Host -> GPU pages in chunk order, up to the first chunk not loaded (its blocks and
        the later ones are reported invalid, for vLLM to recompute). Reported failed, to be
        dropped from the cache: chunks whose disk read failed. True: every block filled."""
        pages, host = self._attached()
        done = LoadCopy()
        try:
            copy_into_pages(load, reads, pages, host, done, after, self.geometry.reference_cpu_mla)
        except Exception as exc:  # never take the engine down: recompute instead
            self._ledger.unexpected("load failed", load.req_id, exc)
            done.fail_all(load)
        for remote, result in done.read_failures:
            self._note_read_failure(remote, result)
        seconds = time.perf_counter() - started
        with self._lock:
            self._ledger.load_over(load.req_id, done.invalid, load.asynchronous,
                                   whole=self.geometry.loads_whole)
            done.report(self._ledger.pending, load.req_id)
            self._ledger.pending.load_seconds[load.req_id] = seconds
            if timed:  # a load cut short by load_timeout says nothing of the disk's speed
                # what was read from storage (in part, for a sliding window's hit), as the
                # scheduler side's ``load_policy`` reckons a load's bytes
                self._ledger.pending.load_samples.append(
                    (done.read_bytes + done.copied["remote"], done.host_bytes, seconds))
            self._ledger.record(lambda st: st.record_load(
                done.chunks, done.copied, done.host_bytes, seconds, len(done.failed_keys),
                done.read_bytes))
        return not done.invalid

    def _note_read_failure(self, remote: bool, result: IOResult) -> None:
        """A failed read, counted against the remote store (``remote``) or the disk path."""
        with self._lock:
            if remote and self._remote is not None:
                self._remote.note_failure(result, "read")
                if result.status is not IOStatus.MISSING:  # gone since the lookup: a miss
                    self._ledger.record(lambda st: st.record_failure("remote_failures"))
            else:
                self._ledger.note_failure(result, "read")

    # -- stores -------------------------------------------------------------------------

    def save(self, meta: StepPlan) -> None:
        """After the forward: write-back demotions, then GPU pages -> host slots (waited
        for), then write-through disk and remote writes in the background (``WorkerSaves``),
        then the checks. Failures are reported, never raised into the engine's step."""
        assert self._saves is not None and self._verify is not None, "register() comes first"
        unfilled, self._unfilled = self._unfilled > 0, max(0, self._unfilled - 1)
        busy = self._saves.save(meta, unfilled)
        if meta.verifies and unfilled:  # this step's KV may have attended unfilled blocks
            self._verify.skip(meta.verifies)
        elif meta.verifies:  # after the stores: checks read slots they may have written back
            self._verify.start(meta.verifies, busy)

    def _submit_reads(self, load: RequestLoad) -> Reads:
        """Start a load's reads into its staging slots: from disk (this rank's, or another
        engine's segment) and from the remote store."""
        reads = self._disk.submit_reads(load)
        if self._remote is not None:
            self._remote.submit_reads(load, reads)
        return reads

    # -- reports ------------------------------------------------------------------------

    def metric_samples(self) -> list[Sample]:
        """This worker's metrics (served on ``metrics_port + 1 + rank``)."""
        return self._ledger.metric_samples()

    def finished(self) -> set[str]:
        """Asynchronous loads over since the last call (their failed blocks are reported by
        ``take_invalid_blocks`` in the same step)."""
        self._finish_ready_loads()
        return self._ledger.take_finished()

    def take_invalid_blocks(self) -> set[int]:
        return self._ledger.take_invalid_blocks()

    def take_failed_loads(self) -> set[str]:
        """Loads among the last ``finished()`` that vLLM must recompute whole
        (``KVGeometry.loads_whole``: hybrid and sliding-window models)."""
        return self._ledger.take_failed_loads()

    def report(self) -> WorkerReport | None:
        return self._ledger.report()

    def stats(self) -> WorkerCounters | None:
        return self._ledger.stats()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for the disk and remote reads and writes started so far (each at most
        ``timeout``); True if none is left."""
        drained = self._lane.drain(timeout)
        return (self._remote is None or self._remote.drain(timeout)) and drained

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Finish loads and background writes, then release host memory, files and threads;
        True when done. Waits at most ``timeout`` seconds (2 s more for a hung mount's paths):
        with disk jobs still running then (a hung drive), queued ones are cancelled and what
        the running ones use stays open until the process exits; vLLM's shutdown goes on."""
        deadline = time.monotonic() + timeout
        self._loader.shutdown(wait=False, cancel_futures=True)
        done = not wait_futures(self._loads.jobs(), timeout=timeout).not_done
        if self._verify is not None:  # its reads go through the lanes too
            done = self._verify.close(max(0.0, deadline - time.monotonic())) and done
        if not done:
            log.error("kvtier worker shut down with loads still running after %g s (a hung drive?)", timeout)
        remote_done = self._remote is None or self._remote.close(  # after the loads' reads
            max(0.0, deadline - time.monotonic()))
        if not self._lane.close(max(0.0, deadline - time.monotonic())) or not done or not remote_done:
            return False  # host memory and cache files stay open for the running I/O
        if self._other_reads is not None:
            self._other_reads.close()
        if self.host is not None:
            self.host.close()
        return True
