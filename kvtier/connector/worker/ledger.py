"""What a worker owes the rest of the engine: its report to the scheduler side, its counters
(to vLLM each step, and since start for the metrics endpoint), the loads it finished and the
blocks (or, for hybrid models, the loads) vLLM must recompute, and failures logged once per
kind."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from kvtier.connector.common.messages import ChunkStore, WorkerReport, without_paths
from kvtier.connector.worker.counters import SOURCES, WorkerCounters
from kvtier.disk.lane import DiskLane, NoDisk
from kvtier.disk.recovery import RecoveredSlot
from kvtier.io.result import IOResult, IOStatus
from kvtier.logs import FailureLog
from kvtier.metrics import Sample


class WorkerLedger:
    """A worker's outcomes, under ``lock`` (the one its disk lane calls back with).

    Contract: the ``note_*``/``record``/``*_locked`` methods are called with ``lock`` held;
    ``take_*``, ``report`` and ``stats`` take it and hand what has gathered over once.
    ``lane`` is the worker's disk lane (set when the worker registers its KV cache).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lane: DiskLane | NoDisk = NoDisk()
        self.failures = FailureLog()
        self.pending = WorkerReport()  # since the last report
        self._stats = WorkerCounters()  # since the last report to vLLM
        self._totals = WorkerCounters(keep_times=False)  # since start, for the metrics endpoint
        self._finished: set[str] = set()
        self._invalid: set[int] = set()
        self._invalid_to_report: set[int] = set()
        self._failed: set[str] = set()  # loads failed as a whole (hybrid models)
        self._failed_to_report: set[str] = set()

    # -- taking the lock -----------------------------------------------------------------

    def store_failed(self, store: ChunkStore) -> None:
        """A store not copied to host: it, and its disk and remote writes (which will not
        run), are reported failed."""
        with self.lock:
            self.pending.host_failed[store.key] += 1
            if store.disk_slot is not None:
                self.pending.disk_failed[store.key] += 1
            if store.remote:
                self.pending.remote_failed[store.key] += 1

    def disk_writes_failed(self, keys: Iterable[bytes]) -> None:
        """Disk writes that will not run: the scheduler side frees their reservations."""
        with self.lock:
            for key in keys:
                self.pending.disk_failed[key] += 1

    def remote_writes_failed(self, keys: Iterable[bytes]) -> None:
        with self.lock:
            for key in keys:
                self.pending.remote_failed[key] += 1

    # -- with the lock held ---------------------------------------------------------------

    def record(self, update: Callable[[WorkerCounters], None]) -> None:
        """Apply ``update`` to the interval and the running statistics."""
        update(self._stats)
        update(self._totals)

    def note_failure(self, result: IOResult, op: str) -> None:
        """Count and log (once per kind) a failed disk request; a path going down is logged
        by the disk tier, once per path."""
        counter = self.lane.note_failure(result, op)
        if counter is not None:
            self.record(lambda st: st.record_failure(counter))
        if result.status is IOStatus.PATH_DOWN:
            self.note_down_paths()

    def note_down_paths(self) -> None:
        """Report each disk path that went out of service, once."""
        for index in self.lane.newly_down():
            self.pending.paths_down[index] += 1
            self.pending.paths_found = without_paths(self.pending.paths_found, {index})

    def path_back(self, index: int, found: Iterable[RecoveredSlot] = ()) -> None:
        """A disk path came back into service: the scheduler side un-retires it, and adopts
        what it holds (``found``: a path out since the start) where every rank holds it."""
        self.pending.paths_up[index] += 1
        for chunk in found:
            self.pending.paths_found[(index, chunk.slot, chunk.header.key)] = (
                1, chunk.header.generation)

    def load_over(self, req_id: str, invalid: set[int], asynchronous: bool,
                  whole: bool = False) -> None:
        """A load is over; vLLM recomputes its ``invalid`` blocks. With ``whole``
        (``KVGeometry.loads_whole``) an asynchronous load with any block invalid is reported
        failed instead, and vLLM recomputes the request."""
        if whole and invalid and asynchronous:  # (the scheduler side makes them all so)
            self._failed.add(req_id)
        else:
            self._invalid |= invalid
        self.pending.loads_done[req_id] += 1
        if asynchronous:
            self._finished.add(req_id)

    # -- taking the lock --------------------------------------------------------------------

    def unexpected(self, what: str, about: str, exc: BaseException) -> None:
        """An exception that was not an I/O result (a bug, or a fault no path reports): the
        blocks are recomputed or the store fails; logged with its traceback once per kind."""
        self.failures.note(f"{what} ({type(exc).__name__})", f"{about} {exc!r}".strip(), exc)

    def take_finished(self) -> set[str]:
        """Asynchronous loads over since the last call; their invalid blocks move to the
        next ``take_invalid_blocks`` (vLLM asks for both in the same step)."""
        with self.lock:
            done, self._finished = self._finished, set()
            self._invalid_to_report |= self._invalid
            self._invalid = set()
            self._failed_to_report |= self._failed
            self._failed = set()
        return done

    def take_failed_loads(self) -> set[str]:
        """Loads failed as a whole among those the last ``take_finished`` returned."""
        with self.lock:
            failed, self._failed_to_report = self._failed_to_report, set()
        return failed

    def take_invalid_blocks(self) -> set[int]:
        with self.lock:
            invalid, self._invalid_to_report = self._invalid_to_report, set()
        return invalid

    def report(self) -> WorkerReport | None:
        with self.lock:
            report, self.pending = self.pending, WorkerReport()
        return None if report.is_empty() else report

    def stats(self) -> WorkerCounters | None:
        with self.lock:
            stats, self._stats = self._stats, WorkerCounters()
        return None if stats.is_empty() else stats

    def metric_samples(self) -> list[Sample]:
        """The worker's metrics (served on ``metrics_port + 1 + rank``)."""
        with self.lock:
            data = dict(self._totals.data)
        load_bytes = Sample("load_bytes_total", "counter", "Bytes copied into GPU blocks, by the "
                            "tier they came from")
        read_first = sum(data[f"load_bytes_{source}"] for source in SOURCES)
        load_bytes.add(data["load_bytes_host"] - read_first, tier="host")
        for source in SOURCES:
            load_bytes.add(data[f"load_bytes_{source}"], tier=source)
        samples = [load_bytes,
                   Sample("load_seconds_total", "counter", "Time spent loading").add(
                       data["load_seconds_sum"]),
                   Sample("io_queue_depth", "gauge", "Disk requests queued or running").add(
                       self.lane.pending())]
        for name in ("loads", "stores", "store_bytes", "disk_writes", "disk_write_bytes",
                     "disk_write_failures", "load_failures", "corruptions", "io_errors",
                     "no_space", "paths_down", "load_timeouts", "chunks_from_remote",
                     "chunks_from_shared", "remote_writes", "remote_write_bytes",
                     "remote_failures", "disk_read_bytes"):
            samples.append(Sample(f"worker_{name}_total", "counter", name.replace("_", " ")).add(
                data[name]))
        return samples
