"""A worker's sampled checks (``ChunkVerify``): a chunk vLLM just computed compared with the
cached copy that would have served it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import torch

from kvtier.config.settings import KVTierConfig
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import ChunkVerify, RequestLoad
from kvtier.connector.worker.ledger import WorkerLedger
from kvtier.connector.worker.load_tracker import Reads
from kvtier.connector.worker.pages import PagedKV
from kvtier.disk.copies import blank_every_copy
from kvtier.disk.lane import DiskLane, NoDisk
from kvtier.io.guarded import started_pool
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.shared.misreads import proves_bad
from kvtier.store.tolerance import same_kv
from kvtier.tiers.host import HostTier


class WorkerVerify:
    """Runs the checks the scheduler side planned, one rank's copy each.

    Contract: ``start(verifies, busy)`` runs on the step's thread right after the step's
    stores: each chunk's fresh pages are copied into a buffer of the check's own (vLLM may
    reuse them after the step), and its cached copy's read starts when it is on storage (into
    its staging slot, as a load's; not when that slot is in ``busy``, still being written
    back). The comparison runs on a thread of its own. Each check ends in the ledger as
    ``verified``, ``verify_differed``, ``verify_undecided`` (bytes of a format kvtier cannot
    decode differ) or ``verify_failed`` (the copy could not be read, in ``load_timeout``, or
    the check could not start); a read given up on is reported in
    ``reads_stalled``, and in ``reads_over`` once it ends. A copy that differed has this
    rank's disk copy (``disk_copy``) blanked before it is reported. ``skip(verifies)``
    ends each check ``verify_skipped`` at once (no verdict: the step's KV may be wrong).
    """

    def __init__(self, pages: PagedKV, host: HostTier, ledger: WorkerLedger,
                 lane: DiskLane | NoDisk, submit_reads: Callable[[RequestLoad], Reads],
                 geometry: KVGeometry, tolerance: float | None, timeout: float | None) -> None:
        self.pages, self.host, self._ledger, self._lane = pages, host, ledger, lane
        self._submit_reads, self._chunk_bytes = submit_reads, geometry.chunk_bytes
        self._layers, self._page_bytes = geometry.num_layers, geometry.page_bytes
        self._dtype = geometry.value_dtype or geometry.kv_dtype  # an fp8 cache's real format
        self._tolerance, self._timeout = tolerance, timeout
        self._kv_run = geometry.kv_run
        self._pool = started_pool(1, "kvtier-verify")  # none to start later, in a step
        self._jobs: list[Future] = []

    @classmethod
    def of(cls, config: KVTierConfig, geometry: KVGeometry, pages: PagedKV, host: HostTier,
           ledger: WorkerLedger, lane: DiskLane | NoDisk,
           submit_reads: Callable[[RequestLoad], Reads]) -> WorkerVerify:
        """The checks of a worker with ``config`` (``verify_tolerance``: per dtype when
        auto) over KV of ``geometry``."""
        return cls(pages, host, ledger, lane, submit_reads, geometry, config.verify_tolerance,
                   config.load_timeout)

    def start(self, verifies: Sequence[ChunkVerify], busy: set[int]) -> None:
        started = []
        for check in verifies:
            source = check.source
            try:
                if source.host_slot is None or source.host_slot in busy:
                    raise RuntimeError("its staging slot is still being written back")
                fresh = torch.empty(self._chunk_bytes, dtype=torch.uint8)
                self.pages.gather(source.block_ids, fresh)
                reads = self._submit_reads(RequestLoad("kvtier-verify", (source,), (), True)) \
                    if source.staged else {}
            except Exception as exc:  # never into vLLM's step: the check is dropped
                self._ledger.unexpected("a sampled check could not start", source.key.hex(), exc)
                self._end(check, "verify_failed")
                continue
            started.append((check, fresh, reads.get(source.key)))
        if started:
            self.pages.synchronize()
        self._jobs = [job for job in self._jobs if not job.done()]
        self._jobs += [self._pool.submit(self._compare, *item) for item in started]

    def _compare(self, check: ChunkVerify, fresh: torch.Tensor, read: Future | None) -> None:
        try:
            self._check(check, fresh, read)
        except Exception as exc:  # a thread of its own: reported, never raised
            self._ledger.unexpected("a sampled check failed", check.source.key.hex(), exc)
            self._end(check, "verify_failed")

    def _check(self, check: ChunkVerify, fresh: torch.Tensor, read: Future | None) -> None:
        source = check.source
        if source.staged and read is None:  # its staging slot holds another chunk's bytes
            raise RuntimeError("a staged copy was never read")
        if read is not None and not self._read_ok(check, read):
            return
        assert source.host_slot is not None
        cached = self.host.slot(source.host_slot)[:self._chunk_bytes]
        # each layer's pages (a tail: its first pages only), each page's K and V on its own
        cached, fresh = (t.view(self._layers, -1, self._page_bytes)[:, :check.blocks]
                         .reshape(-1, self._page_bytes) for t in (cached, fresh))
        same = same_kv(cached, fresh, self._dtype, self._tolerance, cached.shape[0], self._kv_run)
        if same is None:  # bytes of a format kvtier cannot decode differ: it cannot tell
            self._end(check, "verify_undecided")
            return
        if same:
            self._end(check, "verified")
            return
        if check.disk_copy is not None:  # no restart finds it again
            self._lane.invalidate(check.disk_copy, ChunkKey(check.source.key))
        blank_every_copy(self._lane, [ChunkKey(check.source.key)])  # nor an older copy
        self._end(check, "verify_differed")

    def _read_ok(self, check: ChunkVerify, read: Future) -> bool:
        """Whether the cached copy was read (within ``load_timeout``) and checked out."""
        key = check.source.key
        if not wait_futures([read], timeout=self._timeout).done:
            with self._ledger.lock:
                self._ledger.pending.reads_stalled[key] += 1
            self._end(check, "verify_failed")
            read.add_done_callback(lambda _: self._read_over(key))  # then the slot is free
            return False
        result: IOResult = read.result()
        if not result.ok:
            with self._ledger.lock:  # in the report that says the check failed
                if check.source.remote and result.status in (IOStatus.MISSING, IOStatus.CORRUPT):
                    self._ledger.pending.remote_absent.add(key)  # the store lost it, for certain
                if check.source.other is not None and proves_bad(result):
                    self._ledger.pending.other_bad.add(key)  # that copy is bad: as a load's read
                self._ledger.pending.verify_failed[key] += 1
            return False
        return True

    def _read_over(self, key: bytes) -> None:
        with self._ledger.lock:
            self._ledger.pending.reads_over[key] += 1

    def skip(self, verifies: Sequence[ChunkVerify]) -> None:
        """Checks not made: this step's computed KV may be wrong (a load left blocks
        unfilled that it may have attended); no verdict, the cached copies kept."""
        for check in verifies:
            self._end(check, "verify_skipped")

    def _end(self, check: ChunkVerify, outcome: str) -> None:
        with self._ledger.lock:
            getattr(self._ledger.pending, outcome)[check.source.key] += 1

    def close(self, timeout: float) -> bool:
        """Stop taking checks; True when the ones running ended within ``timeout``."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        running = [job for job in self._jobs if not job.cancelled()]  # (a cancel tells no
        return not wait_futures(running, timeout=timeout).not_done  # ``wait``er)
