"""A worker's stores after each forward: write-back demotions first, then GPU pages into
host slots (waited for), then the write-through disk writes and the remote writes in the
background; whatever fails is reported as failed stores, never raised into the step."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.connector.common.messages import ChunkStore, DiskWrite, RemoteWrite, StepPlan
from kvtier.connector.worker.disk import WorkerDisk
from kvtier.connector.worker.ledger import WorkerLedger
from kvtier.connector.worker.pages import PagedKV
from kvtier.connector.worker.remote import WorkerRemote
from kvtier.disk.lane import DiskLane, NoDisk
from kvtier.shared.reads import OtherReads
from kvtier.tiers.host import HostTier


class WorkerSaves:
    """The save half of one worker (``WorkerSide.save``), made once its KV cache is known."""

    def __init__(self, pages: PagedKV, host: HostTier, lane: DiskLane | NoDisk,
                 other_reads: OtherReads | None, disk: WorkerDisk, remote: WorkerRemote | None,
                 ledger: WorkerLedger, chunk_bytes: int, load_timeout: float | None) -> None:
        self.pages, self.host, self._lane, self._other_reads = pages, host, lane, other_reads
        self._disk, self._remote, self._ledger = disk, remote, ledger
        self._chunk_bytes, self._load_timeout = chunk_bytes, load_timeout

    def save(self, meta: StepPlan, unfilled: bool = False) -> set[int]:
        """After the forward: write-back demotions, then GPU pages -> host slots (waited
        for), then write-through disk writes (and those written again) in the background.
        Failures are reported as failed stores, never raised into the step; so is every
        store when ``unfilled``: a synchronous load of this step or the last left blocks
        unfilled, which this step's forward may have attended, in any request (vLLM's
        prefix cache shares a block a synchronous load fills from its allocation on, and
        with asynchronous scheduling the next step was planned before the failure was
        told); vLLM recomputes what attended them.
        Returns the host slots whose write-back still runs (past ``load_timeout``)."""
        pages, host = self.pages, self.host
        self._lane.poll()
        self._disk.note_stalled_writes(self._load_timeout)  # a hung drive: taken out (below)
        if self._other_reads is not None:
            self._other_reads.kept.sweep_soon()  # files of segments reclaimed since: space goes back
        with self._ledger.lock:
            self._ledger.note_down_paths()  # taken out by a check of its own (its lease)
        busy = self._demote(meta.demotions)
        stored: list[ChunkStore] = []
        for store in meta.stores:
            if store.host_slot in busy or unfilled:  # its write-back still
                self._ledger.store_failed(store)  # reads the slot, or its KV is wrong
                continue
            try:
                pages.gather(store.block_ids, host.slot(store.host_slot))
                stored.append(store)
            except Exception as exc:
                self._ledger.unexpected("copy of a chunk to host failed", store.key.hex(), exc)
                self._ledger.store_failed(store)
        pages.synchronize()
        self._disk.keep_records(stored)
        with self._ledger.lock:
            for store in stored:
                self._ledger.pending.host_stored[store.key] += 1
            self._ledger.record(lambda st: st.record_stores(
                len(stored), len(stored) * self._chunk_bytes))
        self._write_disk(stored, meta.rewrites)
        self._write_remote([RemoteWrite(s.key, s.host_slot) for s in stored if s.remote]
                           + meta.remote_writes)
        return busy

    def _write_disk(self, stored: list[ChunkStore], again: Sequence[DiskWrite]) -> None:
        """The write-through disk writes of the chunks just stored, and those written again
        (``StepPlan.rewrites``: from host slots pinned since), in the background."""
        writes = [(s.disk_slot, s.key, s.host_slot) for s in stored if s.disk_slot is not None]
        writes += [(w.disk_slot, w.key, w.host_slot) for w in again]
        if writes:
            try:
                self._disk.submit_writes(writes)
            except Exception as exc:
                self._ledger.unexpected("disk writes could not start", "", exc)
                self._ledger.disk_writes_failed(key for _, key, _ in writes)

    def _demote(self, demotions: Sequence[DiskWrite]) -> set[int]:
        """Write-back demotions before the stores into their host slots, waited for at most
        ``load_timeout`` (a hung drive must not hold up the step): the host slots whose
        write still runs then, which this step's stores must leave alone (the scheduler
        side keeps them reserved until the write is over)."""
        try:
            busy = self._disk.demote(demotions, self._load_timeout)
        except Exception as exc:
            self._ledger.unexpected("write-back of evicted chunks failed", "", exc)
            self._ledger.disk_writes_failed(demotion.key for demotion in demotions)
            return {demotion.host_slot for demotion in demotions}  # not known to be over
        if busy:
            self._ledger.failures.note(
                "write-back timed_out", f"{len(busy)} evicted chunks not on disk after "
                f"{self._load_timeout:g} s (load_timeout; a hung drive?): the stores "
                "into their host slots are dropped")
        return busy

    def _write_remote(self, writes: list[RemoteWrite]) -> None:
        """Remote writes (of chunks just stored, and those the scheduler side planned),
        queued in the background."""
        if not writes:
            return
        try:
            if self._remote is None:
                raise RuntimeError("remote writes before register()")
            self._remote.write(writes)
        except Exception as exc:
            self._ledger.unexpected("remote writes could not start", "", exc)
            self._ledger.remote_writes_failed(write.key for write in writes)
