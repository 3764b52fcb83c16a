"""The connector's worker side: moves bytes as the scheduler side planned.

One per model-runner process (TP rank). It owns the host slots and this rank's disk files,
copies pages between vLLM's paged cache and host slots, drives disk reads and writes, and
reports every outcome back (``WorkerReport``), finished loads (``get_finished``) and the
blocks of chunks that failed to load (so vLLM recomputes them).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from functools import partial
from typing import Any, Protocol

import torch

from kvtier.config import KVTierConfig
from kvtier.connector.counters import WorkerCounters
from kvtier.connector.geometry import KVGeometry
from kvtier.connector.messages import ChunkStore, DiskWrite, RequestLoad, StepPlan, WorkerReport
from kvtier.connector.pages import PagedKV
from kvtier.io.buffers import align_up
from kvtier.io.engine import CLOSE_TIMEOUT_S, IOEngine
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.stats import FailureLog
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_lane import DiskLane, NoDisk, open_lane
from kvtier.tiers.host import HostTier, make_host_tier

log = logging.getLogger("kvtier")
SWITCH_INTERVAL_S = 0.0005


class WorkerSide:
    def __init__(self, config: KVTierConfig, geometry: KVGeometry, namespace: Namespace) -> None:
        self.config, self.geometry, self.namespace = config, geometry, namespace
        self.pages: PagedKV | None = None
        self.host: HostTier | None = None
        self._lane: DiskLane | NoDisk = NoDisk()
        self._loader = ThreadPoolExecutor(2, thread_name_prefix="kvtier-load")
        self._lock = threading.Lock()
        self._report = WorkerReport()
        self._stats = WorkerCounters()  # since the last report to vLLM
        self._totals = WorkerCounters()  # since start, for the metrics endpoint
        self._finished_loads: set[str] = set()
        self._pending_loads: list[tuple[RequestLoad, _Outcome, float]] = []
        self._invalid_blocks: set[int] = set()
        self._invalid_to_report: set[int] = set()
        self._failures = FailureLog()
        self._stalled: list[tuple[bytes, _Outcome]] = []  # given up on, still running
        self._abandoned: set[str] = set()  # loads given up on before their reads started

    @property
    def disk(self) -> DiskTier | None:
        """This rank's disk tier (None without ``disk_paths``), for inspection."""
        return self._lane.tier

    @property
    def _engine(self) -> IOEngine | None:
        return self._lane.engine

    def _attached(self) -> tuple[PagedKV, HostTier]:
        assert self.pages is not None and self.host is not None, "register() comes first"
        return self.pages, self.host

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's KV tensors and allocate the host slots and disk files."""
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            # The engine loop is a busy Python thread: without this, every disk thread waits
            # up to 5 ms for the GIL each time one of its reads returns.
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.pages = PagedKV(list(kv_caches.values()), self.geometry)
        slot_bytes = align_up(self.geometry.chunk_bytes)
        self.host = make_host_tier(self.config.host_capacity, slot_bytes)
        element_bytes = next(iter(kv_caches.values())).element_size()
        self._lane = open_lane(self.config, self.namespace, self.geometry.chunk_bytes,
                               element_bytes, lock=self._lock, on_back=self._path_back,
                               failures=self._failures)
        self._lane.recover(threads=self.config.io_threads)
        with self._lock:
            self._report_down_paths()  # logged by the tier
        log.info("kvtier worker: %d host slots of %d bytes, disk %s", self.host.num_slots,
                 slot_bytes, f"{self._lane.num_slots} slots" if self._lane.num_slots else "off")

    # -- loads --------------------------------------------------------------------------

    def start_loads(self, meta: StepPlan) -> None:
        """Loads from host memory run now (vLLM calls this before the forward that needs
        them); loads with disk chunks start their reads and finish in a later step."""
        for load in meta.loads:
            try:
                if not load.asynchronous:
                    self._complete(load, {}, time.perf_counter())
                elif load.demotions:  # write-back victims must leave the staging slots first
                    job = self._loader.submit(self._demote_then_read, load)
                    self._pending_loads.append((load, job, time.perf_counter()))
                else:
                    self._pending_loads.append((load, _Done(self._submit_reads(load)),
                                                time.perf_counter()))
            except Exception as exc:  # never take the step down: the blocks are recomputed
                self._unexpected("load could not start", load.req_id, exc)
                failed = {c.key: _Failed(repr(exc)) for c in load.chunks}
                self._complete(load, failed, time.perf_counter())
                if load.asynchronous:
                    with self._lock:
                        self._finished_loads.add(load.req_id)

    def _finish_ready_loads(self) -> None:
        """Complete the asynchronous loads whose disk reads are all over, or whose time
        (``load_timeout``) is up (this thread)."""
        waiting = []
        timeout = self.config.load_timeout
        now = time.perf_counter()
        for load, reads_job, started in self._pending_loads:
            if not reads_job.done():
                if timeout is not None and now - started >= timeout:
                    self._abandon(load, reads_job, started, timeout)
                else:
                    waiting.append((load, reads_job, started))
                continue
            try:
                reads = reads_job.result()
            except Exception as exc:
                self._unexpected("disk reads could not start", load.req_id, exc)
                reads = {c.key: _Failed(repr(exc)) for c in load.chunks if c.disk_slot is not None}
            late = {key for key, read in reads.items() if not read.done()}
            if late and (timeout is None or now - started < timeout):
                waiting.append((load, reads_job, started))
                continue
            if late:  # a hung disk: recompute; the slots stay taken until the reads end
                detail = f"no answer from disk after {timeout:g} s (load_timeout); recomputed"
                self._stalled += [(key, reads[key]) for key in late]
                slots = {c.key: c.disk_slot for c in load.chunks if c.disk_slot is not None}
                went_down = [self._lane.note_timeout(slots[key]) for key in late]
                with self._lock:
                    self._report.reads_stalled.update(late)
                    if any(went_down):
                        self._report_down_paths()
                reads = {key: _Failed(detail, IOStatus.TIMED_OUT) if key in late else read
                         for key, read in reads.items()}
            self._complete(load, reads, started, timed=not late)
            self._finished_loads.add(load.req_id)
        self._pending_loads = waiting
        self._release_stalled()

    def _abandon(self, load: RequestLoad, job: _Outcome, started: float, timeout: float) -> None:
        """A load still writing back its staging slots' previous chunks after ``timeout``:
        recompute it. Its reads will not start; its staging slots stay taken until the job
        (and any read it did start) is over, as the write-back still reads from them."""
        with self._lock:
            self._abandoned.add(load.req_id)
        staged = [c.key for c in load.chunks if c.disk_slot is not None and c.host_slot is not None]
        over = _JobReads(job)
        self._stalled += [(key, over) for key in staged]
        with self._lock:
            self._report.reads_stalled.update(staged)
        detail = f"write-back before the load not over after {timeout:g} s (load_timeout)"
        self._complete(load, {key: _Failed(detail, IOStatus.TIMED_OUT) for key in staged},
                       started, timed=False)
        self._finished_loads.add(load.req_id)

    def _release_stalled(self) -> None:
        """Report the given-up reads that have ended: their staging slots may be reused."""
        ended = [(key, read) for key, read in self._stalled if read.done()]
        if ended:
            self._stalled = [(key, read) for key, read in self._stalled if not read.done()]
            with self._lock:
                self._report.reads_over.update(key for key, _ in ended)
                for _, read in ended:  # what the late reads came to (a path may be down)
                    result = read.result()
                    if not result.ok:
                        self._note_failure(result, "read")

    def _complete(self, load: RequestLoad, reads: dict, started: float,
                  timed: bool = True) -> None:
        """Host -> GPU pages in chunk order, up to the first chunk not loaded (its blocks and
        the later ones are reported invalid, for vLLM to recompute). Reported failed, to be
        dropped from the cache: chunks whose disk read failed."""
        pages, host = self._attached()
        failed_keys: set[bytes] = set()
        invalid: set[int] = set()
        disk_bytes = host_bytes = 0
        try:
            broken = False
            for chunk in load.chunks:
                result = reads[chunk.key].result() if chunk.key in reads else None
                if result is not None and not result.ok:
                    failed_keys.add(chunk.key)
                    with self._lock:
                        self._note_failure(result, "read")
                if broken or chunk.host_slot is None or chunk.key in failed_keys:
                    broken = True
                    invalid.update(chunk.block_ids)
                    continue
                pages.scatter(host.slot(chunk.host_slot), chunk.block_ids, chunk.first_block)
                moved = len(chunk.block_ids) * self.geometry.page_bytes * self.geometry.num_layers
                host_bytes += moved
                disk_bytes += moved if result is not None else 0
            pages.synchronize()
        except Exception as exc:  # never take the engine down: recompute instead
            self._unexpected("load failed", load.req_id, exc)
            invalid.update(b for c in load.chunks for b in c.block_ids)
            failed_keys.update(c.key for c in load.chunks if c.key)
        seconds = time.perf_counter() - started
        with self._lock:
            self._invalid_blocks |= invalid
            self._report.loads_done[load.req_id] += 1
            if failed_keys:
                self._report.load_failed[load.req_id] = failed_keys
            if timed:  # a load cut short by load_timeout says nothing of the disk's speed
                self._report.load_samples.append((disk_bytes, host_bytes, seconds))
            self._record(lambda st: st.record_load(load, disk_bytes, host_bytes, seconds,
                                                   len(failed_keys)))

    def _submit_reads(self, load: RequestLoad) -> dict[bytes, _Outcome]:
        """Start the disk reads of a load, neighbouring slots together, one job per path."""
        _, host = self._attached()
        wanted = sorted((c.disk_slot, c.host_slot, c.key) for c in load.chunks
                        if c.disk_slot is not None and c.host_slot is not None)
        if not wanted:
            return {}
        futures: dict[bytes, _Outcome] = {}
        batches: list[Future] = []
        try:
            for queue in self._lane.queues:
                mine = [w for w in wanted if self._lane.queue_of(w[0]) == queue]
                size = -(-len(mine) // self.config.io_threads)  # spread over the path's threads
                for start in range(0, len(mine), size or 1):
                    group = mine[start:start + size]
                    items = [(disk, ChunkKey(key), host.slot_array(slot)) for disk, slot, key in group]
                    batch = self._lane.submit(queue, partial(self._lane.read_many, items))
                    batches.append(batch)
                    for i, (_, _, key) in enumerate(group):
                        futures[key] = _Item(batch, i)
        except BaseException:
            # The load fails and its staging slots go back: no read may still be filling them.
            wait_futures(batches)
            raise
        return futures

    # -- stores -------------------------------------------------------------------------

    def save(self, meta: StepPlan) -> None:
        """After the forward: write-back demotions, then GPU pages -> host slots (waited
        for), then write-through disk writes in the background. Failures are reported as
        failed stores, never raised into the engine's step."""
        pages, host = self._attached()
        self._lane.poll()
        try:
            self._demote(meta.demotions)
        except Exception as exc:
            self._unexpected("write-back of evicted chunks failed", "", exc)
            with self._lock:
                for demotion in meta.demotions:
                    self._report.disk_failed[demotion.key] += 1
        stored: list[ChunkStore] = []
        for store in meta.stores:
            try:
                pages.gather(store.block_ids, host.slot(store.host_slot))
                stored.append(store)
            except Exception as exc:
                self._unexpected("copy of a chunk to host failed", store.key.hex(), exc)
                with self._lock:
                    self._report.host_failed[store.key] += 1
        pages.synchronize()
        with self._lock:
            for store in stored:
                self._report.host_stored[store.key] += 1
            self._record(lambda st: st.record_stores(len(stored),
                                                     len(stored) * self.geometry.chunk_bytes))
        writes = [(s.disk_slot, s.key, s.host_slot) for s in stored if s.disk_slot is not None]
        if writes:
            try:
                self._submit_writes(writes)
            except Exception as exc:
                self._unexpected("disk writes could not start", "", exc)
                with self._lock:
                    for _, key, _ in writes:
                        self._report.disk_failed[key] += 1

    def _demote_then_read(self, load: RequestLoad) -> dict[bytes, _Outcome]:
        try:
            self._demote(load.demotions)
        except Exception:
            with self._lock:  # the scheduler side frees their disk reservations
                self._abandoned.discard(load.req_id)
                for demotion in load.demotions:
                    self._report.disk_failed[demotion.key] += 1
            raise
        with self._lock:
            if load.req_id in self._abandoned:  # given up on meanwhile: read nothing
                self._abandoned.discard(load.req_id)
                return {}
        return self._submit_reads(load)

    def _demote(self, demotions: Sequence[DiskWrite]) -> None:
        """Write-back demotions: written now, since their host slots are about to be reused."""
        if demotions:
            for _, future in self._submit_writes([(d.disk_slot, d.key, d.host_slot)
                                                   for d in demotions]):
                future.result()

    def _submit_writes(self, items: list[tuple[int, bytes, int]]) -> list[tuple[list[ChunkKey], Future]]:
        _, host = self._attached()
        started = []
        for queue in self._lane.queues:
            mine = [(d, ChunkKey(k), host.slot_array(h)) for d, k, h in items
                    if self._lane.queue_of(d) == queue]
            if mine:
                future = self._lane.submit(queue, partial(self._write, mine))
                started.append(([k for _, k, _ in mine], future))
        return started

    def _write(self, items: list) -> None:
        results = self._lane.write_many(items)
        with self._lock:
            for (_, key, _), result in zip(items, results, strict=True):
                if result.ok:
                    self._report.disk_written[key] += 1
                else:
                    self._report.disk_failed[key] += 1
                    self._note_failure(result, "write")
            self._record(lambda st: st.record_disk_writes(results))

    def _note_failure(self, result: IOResult, op: str) -> None:
        """Count and log (once per kind) a failed disk request (lock held); a path going
        down is logged by the disk tier, once per path."""
        counter = self._lane.note_failure(result, op)
        if counter is not None:
            self._record(lambda st: st.record_failure(counter))
        if result.status is IOStatus.PATH_DOWN:
            self._report_down_paths()

    def _report_down_paths(self) -> None:
        """Report each disk path that went out of service, once (lock held)."""
        for index in self._lane.newly_down():
            self._report.paths_down[index] += 1

    def _path_back(self, index: int) -> None:
        """A disk path came back into service (lock held): the scheduler side un-retires it."""
        self._report.paths_up[index] += 1

    def _unexpected(self, what: str, about: str, exc: BaseException) -> None:
        """An exception that was not an I/O result (a bug, or a fault no path reports): the
        blocks are recomputed or the store fails; logged with its traceback once per kind."""
        self._failures.note(f"{what} ({type(exc).__name__})", f"{about} {exc!r}".strip(), exc)

    # -- reports ------------------------------------------------------------------------

    def _record(self, update) -> None:
        """Apply ``update`` to the interval and the running statistics (lock held)."""
        update(self._stats)
        update(self._totals)

    def metric_samples(self) -> list:
        """This worker's metrics (served on ``metrics_port + 1 + rank``)."""
        from kvtier.metrics import Sample

        with self._lock:
            data = dict(self._totals.data)
        load_bytes = Sample("load_bytes_total", "counter", "Bytes copied into GPU blocks, by the "
                            "tier they came from")
        load_bytes.add(data["load_bytes_host"] - data["load_bytes_disk"], tier="host")
        load_bytes.add(data["load_bytes_disk"], tier="disk")
        samples = [load_bytes,
                   Sample("load_seconds_total", "counter", "Time spent loading").add(
                       sum(data["load_seconds"])),
                   Sample("io_queue_depth", "gauge", "Disk requests queued or running").add(
                       self._lane.pending())]
        for name in ("loads", "stores", "store_bytes", "disk_writes", "disk_write_bytes",
                     "disk_write_failures", "load_failures", "corruptions", "io_errors",
                     "no_space", "paths_down", "load_timeouts"):
            samples.append(Sample(f"worker_{name}_total", "counter", name.replace("_", " ")).add(
                data[name]))
        return samples

    def finished(self) -> set[str]:
        """Asynchronous loads over since the last call (their failed blocks are reported by
        ``take_invalid_blocks`` in the same step)."""
        self._finish_ready_loads()
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
            self._invalid_to_report |= self._invalid_blocks
            self._invalid_blocks = set()
        return done

    def take_invalid_blocks(self) -> set[int]:
        with self._lock:
            invalid, self._invalid_to_report = self._invalid_to_report, set()
        return invalid

    def report(self) -> WorkerReport | None:
        with self._lock:
            report, self._report = self._report, WorkerReport()
        return None if report.is_empty() else report

    def stats(self) -> WorkerCounters | None:
        with self._lock:
            stats, self._stats = self._stats, WorkerCounters()
        return None if stats.is_empty() else stats

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Finish loads and background writes, then release host memory, files and threads;
        True when done. Waits at most ``timeout`` seconds: with disk jobs still running then
        (a hung drive), queued ones are cancelled and the memory and files the running ones
        use stay open until the process exits, so vLLM's shutdown goes on."""
        deadline = time.monotonic() + timeout
        loads = [job for _, job, _ in self._pending_loads if isinstance(job, Future)]
        self._loader.shutdown(wait=False, cancel_futures=True)
        done = not wait_futures(loads, timeout=timeout).not_done
        if not done:
            log.error("kvtier worker shut down with loads still running after %g s (a hung "
                      "drive?)", timeout)
        # after the loads: they submit reads to the lane
        if not self._lane.close(max(0.0, deadline - time.monotonic())) or not done:
            return False  # host memory and cache files stay open for the running I/O
        if self.host is not None:
            self.host.close()
        return True


class _Outcome(Protocol):
    """What a load waits on: a ``Future`` or one of the stand-ins below."""

    def done(self) -> bool: ...

    def result(self) -> Any: ...


class _Done:
    """An already-available value behind the ``done``/``result`` interface of a future."""

    def __init__(self, value) -> None:
        self._value = value

    def done(self) -> bool:
        return True

    def result(self):
        return self._value


class _Failed(_Done):
    """A read that could not be started, or was given up on."""

    def __init__(self, detail: str, status: IOStatus = IOStatus.IO_ERROR) -> None:
        super().__init__(IOResult(status, detail=detail))


class _JobReads:
    """Over when a load's write-back-then-read job and every read it started are over."""

    def __init__(self, job: _Outcome) -> None:
        self._job = job

    def done(self) -> bool:
        if not self._job.done():
            return False
        try:
            reads = self._job.result()
        except Exception:
            return True
        return all(read.done() for read in reads.values())

    def result(self) -> IOResult:
        return IOResult(IOStatus.OK)


class _Item:
    """One chunk's result out of a batched read."""

    def __init__(self, batch: Future, index: int) -> None:
        self._batch, self._index = batch, index

    def done(self) -> bool:
        return self._batch.done()

    def result(self) -> IOResult:
        try:
            return self._batch.result()[self._index]
        except Exception as exc:
            return IOResult(IOStatus.IO_ERROR, detail=repr(exc))
