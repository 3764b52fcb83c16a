"""One rank's disk reads and writes between its host slots and its disk lane, grouped per
path and into neighbouring runs, with their outcomes written into the worker's ledger."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from functools import partial

import numpy as np

from kvtier.connector.common.messages import ChunkStore, DiskWrite, RequestLoad
from kvtier.connector.worker.ledger import WorkerLedger
from kvtier.connector.worker.load_tracker import ReadGate, Reads, after_all, failed_read
from kvtier.disk.lane import DiskLane, NoDisk
from kvtier.io.batch_reads import ReadGroup, start_groups
from kvtier.io.guarded import cancel, submit_guarded
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.shared.reads import OtherReads, SlotRef
from kvtier.tiers.host import HostTier


class WorkerDisk:
    """Starts a load's disk reads and a step's disk writes on the lane's queues.

    Contract: ``submit_reads(load)`` returns at once a ``Future`` per disk chunk (settled
    before its job is over); ``submit_writes(items)`` returns the started write jobs, whose
    outcomes go into the ledger's report (``disk_written`` / ``disk_failed``);
    ``demote(demotions, timeout)`` writes and waits (write-back victims leaving their host
    slots), at most ``timeout``. ``keep_records(stores)`` keeps the token record of each
    chunk just stored into a host slot, for the slot's disk writes (write-through now,
    write-back later) to put in its header.
    A corrupt slot's header is blanked by its read job, before the load can report it.
    """

    def __init__(self, lane: DiskLane | NoDisk, host: HostTier, ledger: WorkerLedger,
                 threads: int, other_reads: OtherReads | None = None, rank: int = 0) -> None:
        self._lane, self._host, self._ledger, self._threads = lane, host, ledger, threads
        self._other_reads, self._rank = other_reads, rank
        self._records: dict[int, tuple[bytes, bytes]] = {}  # host slot -> (key, token record)
        self._writing: dict[Future, tuple[float, int, list]] = {}  # jobs out: (since, slot, keys)
        self._counted: dict[str, float] = {}  # path's queue -> when its stall last counted

    def keep_records(self, stores: Sequence[ChunkStore]) -> None:
        for store in stores:
            if store.record:
                self._records[store.host_slot] = (store.key, store.record)
            else:
                self._records.pop(store.host_slot, None)

    def record(self, host_slot: int, key: bytes) -> bytes:
        """The token record kept for ``key`` in ``host_slot`` (b"": none)."""
        kept = self._records.get(host_slot)
        return kept[1] if kept is not None and kept[0] == key else b""

    def submit_reads(self, load: RequestLoad) -> Reads:
        """Start the disk reads of a load, neighbouring slots together, one job per path."""
        host = self._host
        wanted = sorted((c.disk_slot, c.host_slot, c.key, c.parts) for c in load.chunks
                        if c.disk_slot is not None and c.host_slot is not None)
        groups: list[ReadGroup] = []
        keys: list[bytes] = []
        for queue in self._lane.queues if wanted else ():
            for group in self._spread([w for w in wanted if self._lane.queue_of(w[0]) == queue]):
                items = [(disk, ChunkKey(key), host.slot_array(slot), parts)
                         for disk, slot, key, parts in group]
                groups.append(ReadGroup(len(items), partial(self._read, items),
                                        partial(self._lane.submit, queue)))
                keys += [key for _, _, key, _ in group]
        futures: Reads = {}
        groups += self._other_groups(load, futures, keys)
        started = start_groups(groups)
        futures.update(zip(keys, started.reads, strict=True))
        if started.refused is not None:
            # The load fails and its staging slots go back: no read may still be filling them.
            wait_futures(started.jobs)
            raise started.refused
        return futures

    def demote_then_read(self, load: RequestLoad, gate: ReadGate,
                         read: Callable[[RequestLoad], Reads], pool: ThreadPoolExecutor) -> Future[Reads]:
        """A load's write-back demotions (out of its staging slots) started, then, once
        every one is over, its reads (``read``, run on ``pool``), unless the load was given
        up on meanwhile (``gate``): the future of its reads. No thread waits on the writes
        meanwhile: one drive that stops answering holds up only the loads writing to it. A
        write job that raised fails the load (the scheduler side frees the demotions' disk
        reservations)."""
        job: Future[Reads] = Future()
        try:
            started = self.submit_writes([(d.disk_slot, d.key, d.host_slot) for d in load.demotions])
        except Exception as exc:  # the scheduler side frees their disk reservations
            self._ledger.disk_writes_failed(demotion.key for demotion in load.demotions)
            job.set_exception(exc)
            return job

        def writes_over() -> None:
            raised = [f.exception() for _, f in started if not f.cancelled() and f.exception()]
            if raised:
                self._ledger.disk_writes_failed(demotion.key for demotion in load.demotions)
                job.set_exception(raised[0])
            elif not gate.open():  # given up on meanwhile: read nothing
                job.set_result({})
            else:
                with contextlib.suppress(Exception):  # (refused: the job is cancelled)
                    submit_guarded(pool, read, load, future=job)
        after_all([future for _, future in started], writes_over)
        return job

    def _spread(self, items: list) -> list[list]:
        """A path's reads in as many groups as it has threads."""
        size = -(-len(items) // self._threads) or 1
        return [items[start:start + size] for start in range(0, len(items), size)]

    def _other_groups(self, load: RequestLoad, futures: Reads,
                        keys: list[bytes]) -> list[ReadGroup]:
        """The reads of chunks in other engines' segments, spread over each disk path's
        threads, each chunk read from this rank's copy into its host slot, verified (nothing
        of theirs is ever written, even when a read is corrupt); their keys go on ``keys``."""
        theirs = [(c.other[self._rank], c.host_slot, c.parts) for c in load.chunks
                  if c.other is not None and c.host_slot is not None]
        if theirs and self._other_reads is None:  # no disk tier here: these cannot be read
            for ref, _, _ in theirs:
                futures[ref.key] = failed_read("no disk paths to read another engine's chunk from")
            return []
        queues = self._lane.queues if theirs else []
        groups = []
        for index, queue in enumerate(queues):
            for group in self._spread([t for t in theirs if t[0].path % len(queues) == index]):
                groups.append(ReadGroup(len(group), partial(self._read_other, group),
                                        partial(self._lane.submit, queue)))
                keys += [ref.key for ref, _, _ in group]
        return groups

    def _read_other(self, items: list[tuple[SlotRef, int, tuple[int, ...] | None]]
                      ) -> list[IOResult]:
        """Reads of other engines' chunks: whole ones together (neighbours in one call),
        the others the parts their loads need."""
        reads = self._other_reads
        assert reads is not None, "reads of other engines' chunks need their reader"
        whole = [i for i, (_, _, parts) in enumerate(items) if parts is None]
        results = dict(zip(whole, reads.read_many(
            [(items[i][0], self._host.slot_array(items[i][1])) for i in whole]), strict=True))
        for i, (ref, slot, parts) in enumerate(items):
            if parts is not None:
                results[i] = reads.read_parts(ref, self._host.slot_array(slot), parts)
        return [results[i] for i in range(len(items))]

    def _read(self, items: list[tuple[int, ChunkKey, np.ndarray, tuple[int, ...] | None]]
              ) -> list[IOResult]:
        """Verified reads (an I/O thread): whole chunks, or the parts a load needs of them
        (``ChunkLoad.parts``). A corrupt slot's header is blanked before the load reports
        it failed, so it is not recovered again after a restart; a read given up on that
        ends after the scheduler side freed the slot and another chunk was written there
        leaves that chunk alone (``invalidate`` with the key read)."""
        whole = [i for i, item in enumerate(items) if item[3] is None]
        some = [i for i, item in enumerate(items) if item[3] is not None]
        results: list[IOResult] = [IOResult(IOStatus.IO_ERROR)] * len(items)
        for i, result in zip(whole, self._lane.read_many([items[i][:3] for i in whole]), strict=True):
            results[i] = result
        if some:
            read = self._lane.read_parts([(slot, key, dst, parts or ())
                                          for slot, key, dst, parts in (items[i] for i in some)])
            for i, result in zip(some, read, strict=True):
                results[i] = result
        for (slot, key, _, _), result in zip(items, results, strict=True):
            if result.status is IOStatus.CORRUPT:
                self._lane.invalidate(slot, key)
        return results

    def demote(self, demotions: Sequence[DiskWrite], timeout: float | None = None) -> set[int]:
        """Write-back demotions: written now, since their host slots are about to be reused.
        Waits at most ``timeout`` (None: as long as they take) and returns the host slots
        whose write still runs then (a hung drive): not to be reused until it ends."""
        if not demotions:
            return set()
        slot_of = {d.key: d.host_slot for d in demotions}
        started = self.submit_writes([(d.disk_slot, d.key, d.host_slot) for d in demotions])
        done, _ = wait_futures([future for _, future in started], timeout=timeout)
        late = {slot_of[key] for keys, future in started if future not in done for key in keys}
        for _, future in started:
            if future in done and not future.cancelled():  # (a cancelled job's chunks are
                future.result()  # failed by its cancelling: ``_write_over``)
        return late

    def submit_writes(self, items: list[tuple[int, bytes, int]]) -> list[tuple[list[ChunkKey], Future]]:
        host = self._host
        started = []
        if isinstance(self._lane, DiskLane):  # stamped in the scheduler's order (a prompt's
            for d, _, _ in items:  # head first), not in the order the jobs run
                self._lane.tier.stamps.reserve(d)
        for queue in self._lane.queues:
            mine = [(d, ChunkKey(k), host.slot_array(h)) for d, k, h in items
                    if self._lane.queue_of(d) == queue]
            records = {ChunkKey(k): record for d, k, h in items
                       if self._lane.queue_of(d) == queue and (record := self.record(h, k))}
            if mine:
                try:
                    future = self._lane.submit(queue, partial(self._write, mine, records))
                except Exception as exc:  # (the engine closed): these fail, once each; the
                    self._ledger.unexpected("disk writes could not start", queue, exc)
                    self._ledger.disk_writes_failed(key for _, key, _ in mine)  # others go on
                    continue
                self._writing[future] = (time.monotonic(), mine[0][0], [k for _, k, _ in mine])
                future.add_done_callback(self._write_over)
                started.append(([k for _, k, _ in mine], future))
        return started

    def _write_over(self, future: Future) -> None:
        """A write job ended (an I/O thread), or was cancelled before it ran: then its
        chunks are failed here, once each (its own outcomes never come)."""
        job = self._writing.pop(future, None)
        if job is not None and future.cancelled():
            self._ledger.disk_writes_failed(job[2])

    def note_stalled_writes(self, timeout: float | None) -> bool:
        """A path with a write job out ``timeout`` (``load_timeout``) without ending counts
        against its health, as a load given up on does, again each further ``timeout``
        while it stays so; a write that ends meanwhile sets the count back (a slow drive
        that still writes stays). After three a drive that stopped answering is out of
        service: its queued writes are cancelled and failed, so that the scheduler side
        gives back the host slots they pin; one running keeps its chunks' slots until it
        ends (it reads them). True when a path went out."""
        if timeout is None:
            return False
        now, late = time.monotonic(), dict[str, int]()
        for since, slot, _ in list(self._writing.values()):  # (a copy: they end elsewhere)
            queue = self._lane.queue_of(slot)
            if now - since >= timeout and now - self._counted.get(queue, 0.0) >= timeout:
                late.setdefault(queue, slot)
        out = set()
        for queue, slot in late.items():
            self._counted[queue] = now
            if self._lane.note_timeout(slot):
                out.add(queue)
        for future, (_, slot, _) in list(self._writing.items()):
            if self._lane.queue_of(slot) in out:
                cancel(future)  # only a job not running yet is: its outcome is a failure
        return bool(out)

    def _write(self, items: list, records: dict[ChunkKey, bytes]) -> None:
        """A job of writes (an I/O thread): one outcome per chunk in the ledger, whatever
        happens (an error outside the writes themselves, out of memory in a codec's
        buffers, fails them all), so that no host slot stays pinned for an outcome that
        never comes and none is told twice."""
        try:
            results = self._lane.write_many(items, records)
        except Exception as exc:
            results = [IOResult(IOStatus.IO_ERROR, 0, f"write job failed: {exc!r}")] * len(items)
        with self._ledger.lock:
            for (_, key, _), result in zip(items, results, strict=True):
                if result.ok:
                    self._ledger.pending.disk_written[key] += 1
                else:
                    self._ledger.pending.disk_failed[key] += 1
                    self._ledger.note_failure(result, "write")
            self._ledger.record(lambda st: st.record_disk_writes(results))

