"""One rank's reads and writes between its host slots and the remote store: its own copy of
each chunk (its namespace), loads read in groups on the remote tier's threads, writes as
group commits, outcomes into the worker's ledger."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial

from kvtier.config.settings import KVTierConfig
from kvtier.connector.common.messages import RemoteWrite, RequestLoad
from kvtier.connector.worker.ledger import WorkerLedger
from kvtier.connector.worker.load_tracker import Reads, failed_read
from kvtier.io.batch_reads import READ_GROUP_BYTES, ReadGroup, start_groups
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.lane import RemoteLane, RemotePut
from kvtier.remote.opening import open_remote
from kvtier.tiers.host import HostTier


class WorkerRemote:
    """Contract: ``submit_reads(load, reads)`` adds a ``Future`` per remote chunk of ``load``
    to ``reads`` at once (settled before its job is over; a failed one when there is no
    remote tier here or it is closed); ``write(writes)`` queues the step's remote writes,
    whose outcomes go into the ledger's report (``remote_written`` / ``remote_failed``);
    ``drain(timeout)`` and ``close(timeout)`` as ``RemoteLane`` (True without a remote
    tier). A write that asks for its token record (``RemoteWrite.record``) reports the one
    ``records(host_slot, key)`` gives (``remote_records``) once written."""

    def __init__(self, config: KVTierConfig, namespace: Namespace, raw_bytes: int,
                 host: HostTier, ledger: WorkerLedger, parts: Sequence[int] = ()) -> None:
        self._host, self._ledger, self._raw_bytes = host, ledger, raw_bytes
        self.records: Callable[[int, bytes], bytes] | None = None
        self._wanted: dict[bytes, bytes] = {}  # key -> token record, while its write runs
        tier = open_remote(config, namespace, raw_bytes, parts)
        self._lane = None
        if tier is not None:
            tier.register(host.buffer.array)
            self._lane = RemoteLane(tier, config.io_threads, host.slot_array, self._settle)

    def submit_reads(self, load: RequestLoad, reads: Reads) -> None:
        wanted = [(ChunkKey(c.key), c.host_slot, c.parts) for c in load.chunks
                  if c.remote and c.host_slot is not None]
        if not wanted:
            return
        lane = self._lane
        if lane is None:  # a rank without the remote tier: these cannot be read
            for key, _, _ in wanted:
                reads[key] = failed_read("no remote_url on this worker")
            return
        per_group = max(1, READ_GROUP_BYTES // max(1, self._raw_bytes))
        groups = [wanted[start:start + per_group] for start in range(0, len(wanted), per_group)]
        # a lane closed meanwhile: these reads fail (``start_groups``), and the load goes on
        started = start_groups([ReadGroup(len(group), partial(self._get, group), lane.submit)
                                for group in groups])
        reads.update(zip([key for key, _, _ in wanted], started.reads, strict=True))
        if started.refused is not None and not isinstance(started.refused, Exception):
            raise started.refused  # an interrupt, not a refusal

    def _get(self, items: list[tuple[ChunkKey, int, tuple[int, ...] | None]]) -> list[IOResult]:
        """Read a group of chunks into their host slots: whole, or only the parts their
        loads fill (``ChunkLoad.parts``)."""
        assert self._lane is not None
        tier = self._lane.tier
        keys = [key for key, _, _ in items]
        dsts = [self._host.slot_array(slot) for _, slot, _ in items]
        if all(parts is None for _, _, parts in items):
            return tier.get_many(keys, dsts)
        return tier.get_parts(keys, dsts, [range(len(tier.parts)) if parts is None else parts
                                           for _, _, parts in items])

    def write(self, writes: Sequence[RemoteWrite]) -> None:
        if not writes:
            return
        lane = self._lane
        if lane is None:
            with self._ledger.lock:
                for write in writes:
                    self._ledger.pending.remote_failed[write.key] += 1
            return
        if self.records is not None:
            with self._ledger.lock:
                for w in writes:
                    if w.record and (record := self.records(w.host_slot, w.key)):
                        self._wanted[w.key] = record
        groups = [lane.put(RemotePut(ChunkKey(w.key), w.host_slot))[1] for w in writes]
        for group in groups:
            with contextlib.suppress(RuntimeError):  # closed: settled as never run
                lane.start(group)

    def _settle(self, items: Sequence[RemotePut], results: Sequence[IOResult] | None) -> None:
        with self._ledger.lock:
            for i, item in enumerate(items):
                result = results[i] if results is not None else None
                record = self._wanted.pop(bytes(item.key), b"")
                if result is not None and result.ok:
                    self._ledger.pending.remote_written[bytes(item.key)] += 1
                    if record:
                        self._ledger.pending.remote_records[bytes(item.key)] = record
                    continue
                self._ledger.pending.remote_failed[bytes(item.key)] += 1
                if result is not None:
                    self.note_failure(result, "write")
            if results is not None:
                self._ledger.record(lambda st: st.record_remote_writes(results))

    def note_failure(self, result: IOResult, op: str) -> None:
        """Log (once per kind) a failed remote request (ledger lock held); a chunk the
        store no longer has is a miss, not a failure."""
        if result.status is not IOStatus.MISSING:
            self._ledger.failures.note(f"remote {op} {result.status.value}", result.detail)

    def drain(self, timeout: float | None) -> bool:
        return True if self._lane is None else self._lane.drain(timeout)

    def close(self, timeout: float) -> bool:
        return True if self._lane is None else self._lane.close(timeout)
