"""Copying one load's chunks from host slots into vLLM's pages, in chunk order, up to the
first chunk not loaded: what it came to, for the worker to report."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.connector.common.messages import NULL_BLOCK, RequestLoad, WorkerReport
from kvtier.connector.worker.counters import SOURCES, source_of
from kvtier.connector.worker.load_tracker import Reads
from kvtier.connector.worker.pages import PagedKV
from kvtier.io.result import IOResult, IOStatus
from kvtier.shared.misreads import proves_bad
from kvtier.tiers.host import HostTier


@dataclass
class LoadCopy:
    """What one load's copy came to."""

    invalid: set[int] = field(default_factory=set)  # blocks vLLM must recompute
    failed_keys: set[bytes] = field(default_factory=set)  # reads failed: drop from the cache
    read_failures: list[tuple[bool, IOResult]] = field(default_factory=list)  # (remote, result)
    absent_keys: set[bytes] = field(default_factory=set)  # the remote store does not hold them
    other_bad: set[bytes] = field(default_factory=set)  # another engine's copy proved bad
    host_bytes: int = 0  # copied into vLLM's pages
    read_bytes: int = 0  # read from disk for it
    copied: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    chunks: dict[str, int] = field(default_factory=dict)  # copied, by where: host or a source

    def fail_all(self, load: RequestLoad) -> None:
        """Nothing of ``load`` counts as loaded: every block is recomputed."""
        self.invalid.update(b for c in load.chunks for b in c.block_ids if b != NULL_BLOCK)
        self.failed_keys.update(c.key for c in load.chunks if c.key)
        self.chunks.clear()

    def report(self, pending: WorkerReport, req_id: str) -> None:
        """What the scheduler side learns of it: the keys whose reads failed, those whose
        read proved another engine's copy bad (forgotten), and those the remote store was
        found not to hold (to be written again)."""
        if self.failed_keys:
            pending.load_failed[req_id] = self.failed_keys
        pending.remote_absent |= self.absent_keys
        pending.other_bad |= self.other_bad


def copy_into_pages(load: RequestLoad, reads: Reads, pages: PagedKV, host: HostTier,
                    done: LoadCopy, after: object = None, whole: bool = False) -> None:
    """Copy ``load``'s chunks whose reads (``reads``; none for chunks held in host memory) checked
    out into their pages (after ``after``: ``PagedKV.mark``); from the first that did not, its
    blocks and every later chunk's are invalid, with ``whole`` every block of the load (an engine
    that cannot go on from part of a hit: ``reference_mla``). Raises on a copy that fails (``done``
    says what came before), once the copies queued before it are over (vLLM reuses the blocks)."""
    broken = False
    try:  # a copy that raises still waits for those queued before it (a CUDA stream)
        for chunk in load.chunks:
            result = reads[chunk.key].result() if chunk.key in reads else None
            if result is not None and result.ok and not chunk.remote:
                done.read_bytes += result.nbytes
            if result is not None and not result.ok:
                done.failed_keys.add(chunk.key)
                done.read_failures.append((chunk.remote, result))
                if chunk.remote and result.status in (IOStatus.MISSING, IOStatus.CORRUPT):
                    done.absent_keys.add(chunk.key)
                if chunk.other is not None and proves_bad(result):
                    done.other_bad.add(chunk.key)
            if chunk.fills_nothing:  # out of every group's window: nothing to copy
                continue
            if broken or chunk.host_slot is None or chunk.key in done.failed_keys:
                broken = True
                done.invalid.update(b for b in chunk.block_ids if b != NULL_BLOCK)
                continue
            if chunk.staged and result is None:  # its staging slot holds another chunk
                raise RuntimeError(f"chunk {chunk.key.hex()} was never read into host "
                                   f"slot {chunk.host_slot}")
            pages.scatter(host.slot(chunk.host_slot), chunk.block_ids, chunk.first_block, after)
            moved = pages.bytes_of(chunk.block_ids)
            done.host_bytes += moved
            where = "host" if result is None else source_of(chunk)
            done.chunks[where] = done.chunks.get(where, 0) + 1
            if result is not None:
                done.copied[where] += moved
        if whole and done.invalid:  # vLLM recomputes from the load's first block
            done.invalid.update(b for c in load.chunks for b in c.block_ids if b != NULL_BLOCK)
    finally:
        pages.synchronize()
