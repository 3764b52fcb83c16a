"""What the scheduler side tells the workers each step, and what they report back.

Plain dataclasses (pickled between processes), importable without vLLM: ``connector.py``
gives vLLM its own subclasses of ``StepPlan`` and ``WorkerReport``. Slots are decided by the
scheduler side's bookkeeping; workers only move bytes and report outcomes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Self

from kvtier.shared.reads import SlotRef

# vLLM's null block: block 0 of the pool, which holds nothing. A sliding-window group's blocks
# for tokens out of its window are the null block; a load skips them, a store never has one.
NULL_BLOCK = 0

GroupBlocks = Sequence[Sequence[int]]  # a request's block ids in each KV cache group


def chunk_blocks(groups: GroupBlocks, start: int, stop: int) -> tuple[int, ...]:
    """Blocks ``start`` to ``stop - 1`` of every group, group after group: the ``block_ids``
    of a ``ChunkStore`` or ``ChunkLoad``."""
    return tuple(b for ids in groups for b in ids[start:stop])


@dataclass(frozen=True)
class DiskWrite:
    """Write host slot ``host_slot`` to disk slot ``disk_slot`` (a write-back demotion, run
    before anything reuses the host slot; or a failed write-through write made again)."""

    key: bytes
    host_slot: int
    disk_slot: int


@dataclass(frozen=True)
class ChunkStore:
    """Copy a computed chunk's GPU pages into ``host_slot``; then, if ``disk_slot`` is set,
    write it there in the background (write-through), and with ``remote`` write it to the
    remote store in the background too. ``block_ids``: the chunk's blocks in each KV cache
    group, group after group (one group but for hybrid models). ``record``: its token
    record (``kvtier.io.token_record``), which its disk writes put in the slot's header
    (b"": none). ``req_id``: the request that computed it (a rank whose synchronous load of
    that request failed in the step stores none of its chunks: they attended pages the
    load did not fill)."""

    key: bytes
    block_ids: tuple[int, ...]
    host_slot: int
    disk_slot: int | None = None
    remote: bool = False
    record: bytes = b""
    req_id: str = ""


@dataclass(frozen=True)
class ChunkLoad:
    """Fill GPU blocks ``block_ids`` (each KV cache group's, group after group, as many per
    group; ``NULL_BLOCK`` where a group keeps none) from the chunk's pages ``first_block``
    onwards.

    The pages come from ``host_slot``; when ``disk_slot`` is set they are first read from
    disk into ``host_slot`` and verified; when ``other`` is set (one reference per TP rank,
    in rank order) they are first read from another engine's segment of the shared
    directory the same way; with ``remote``, from the remote store (each rank its own
    copy). ``host_slot`` is None when no host slot could be had: this chunk and the ones
    after it are not loaded, and vLLM recomputes their blocks; or when the chunk fills no
    block (``fills_nothing``: every group's blocks are out of its window), as a hit that
    needs none of its bytes. A read with ``parts`` (from disk, a shared directory or the
    remote store) reads only those KV cache groups' parts of the chunk (the groups whose
    blocks it fills), the whole chunk without.
    """

    key: bytes
    block_ids: tuple[int, ...]
    first_block: int
    host_slot: int | None
    disk_slot: int | None = None
    other: tuple[SlotRef, ...] | None = None
    remote: bool = False
    parts: tuple[int, ...] | None = None

    @property
    def fills_nothing(self) -> bool:
        """Every block is the null block: a sliding window's hit on a chunk it left."""
        return all(b == NULL_BLOCK for b in self.block_ids)

    @property
    def staged(self) -> bool:
        """Read into ``host_slot`` (from disk, a shared directory or the remote store)
        before it loads."""
        return self.disk_slot is not None or self.other is not None or self.remote


@dataclass(frozen=True)
class ChunkVerify:
    """Compare a chunk vLLM just computed (its GPU pages ``source.block_ids``) with the
    cached copy that would have served it (``verify_sample``): ``source`` says where that
    copy is, as a load of it would (its ``host_slot`` holds it, or stages its read from
    disk, a shared directory or the remote store); ``tier`` names that tier. ``disk_copy``:
    the chunk's slot on this engine's disk, whose header a rank blanks when its copy
    differed (so no restart finds it again). ``blocks``: compare only each layer's first
    ``blocks`` pages (a prompt's tail: its last block holds bytes past the prompt)."""

    source: ChunkLoad
    tier: str
    disk_copy: int | None = None
    blocks: int | None = None


@dataclass(frozen=True)
class RemoteWrite:
    """Write the chunk in host slot ``host_slot`` to the remote store (each rank its own
    copy); the slot stays pinned until every rank reported the write over. With
    ``record``, the chunk's token record in that slot (if the worker kept one) comes back
    with the outcome, for the store's log: a write queued without one."""

    key: bytes
    host_slot: int
    record: bool = False


@dataclass(frozen=True)
class RequestLoad:
    req_id: str
    chunks: tuple[ChunkLoad, ...]
    demotions: tuple[DiskWrite, ...] = ()
    asynchronous: bool = False  # vLLM waits for the worker to report it finished


@dataclass
class StepPlan:
    """Scheduler -> workers, once per step."""

    loads: list[RequestLoad] = field(default_factory=list)
    demotions: list[DiskWrite] = field(default_factory=list)  # before ``stores``
    stores: list[ChunkStore] = field(default_factory=list)
    remote_writes: list[RemoteWrite] = field(default_factory=list)  # after ``stores``
    # after ``stores``, in the background: a producer's failed write-through disk writes
    # written again from their host slots (pinned) to new disk slots
    rewrites: list[DiskWrite] = field(default_factory=list)
    verifies: list[ChunkVerify] = field(default_factory=list)  # after ``stores``


@dataclass
class WorkerReport:
    """Workers -> scheduler: outcomes since the last report, counted over ranks.

    ``host_stored``/``disk_written`` count successes per chunk key; ``*_failed`` count
    failures. ``load_failed`` maps a request to the keys whose load failed on some rank;
    ``paths_down``/``paths_up`` count, by disk path index, the ranks that took the path out
    of service / brought it back since the last report. ``reads_stalled`` counts the ranks
    whose read of a chunk was given up (``load_timeout``) while it may still be filling the
    chunk's staging slot; ``reads_over`` those whose read has ended since: only then may the
    slot be reused. ``remote_written``/``remote_failed`` count the ranks' remote writes.
    ``load_seconds``: each load's time, the slowest rank's. ``verified``/``verify_differed``/
    ``verify_failed`` count, per chunk key, the ranks whose cached copy matched what was
    computed, differed from it, or could not be read (a ``ChunkVerify``); ``verify_undecided``
    those whose bytes differed in a format kvtier cannot decode (no verdict);
    ``verify_skipped`` those whose check was not made (a step whose computed KV may be wrong:
    a load left blocks unfilled): no verdict, the copy kept. ``remote_absent``:
    the keys a rank's remote read found the store without (missing, or a value not the
    chunk's); a read that failed otherwise (a timeout, a redirect) says nothing of it.
    ``other_bad``: the keys whose read (a load's or a check's) of another engine's copy
    proved that copy bad (``kvtier.shared.misreads.proves_bad``); another failure of such a
    read (an I/O error, a short read, a timeout) says nothing of the copy. ``paths_found``:
    what a path back after being out since the start holds, by (path, slot, key): the ranks
    that found that key in that slot, and the oldest of their generations for it; a path
    taken out again since is not in it (a rank's report, and one ``merged`` after it).
    """

    host_stored: Counter = field(default_factory=Counter)
    host_failed: Counter = field(default_factory=Counter)
    disk_written: Counter = field(default_factory=Counter)
    disk_failed: Counter = field(default_factory=Counter)
    load_failed: dict = field(default_factory=dict)
    paths_down: Counter = field(default_factory=Counter)
    load_samples: list = field(default_factory=list)  # (disk bytes, host bytes, seconds)
    loads_done: Counter = field(default_factory=Counter)  # request id -> ranks done
    paths_up: Counter = field(default_factory=Counter)
    reads_stalled: Counter = field(default_factory=Counter)
    reads_over: Counter = field(default_factory=Counter)
    remote_written: Counter = field(default_factory=Counter)
    remote_failed: Counter = field(default_factory=Counter)
    load_seconds: dict = field(default_factory=dict)  # request id -> its load's seconds (slowest rank)
    verified: Counter = field(default_factory=Counter)
    verify_differed: Counter = field(default_factory=Counter)
    verify_failed: Counter = field(default_factory=Counter)
    remote_records: dict = field(default_factory=dict)  # key -> token record (``RemoteWrite``)
    remote_absent: set = field(default_factory=set)
    verify_undecided: Counter = field(default_factory=Counter)
    other_bad: set = field(default_factory=set)
    paths_found: dict = field(default_factory=dict)  # (path, slot, key) -> (ranks, generation)
    verify_skipped: Counter = field(default_factory=Counter)

    @classmethod
    def of(cls, report: WorkerReport) -> Self:
        """The same outcomes as a ``cls`` (for vLLM's subclass)."""
        return cls(**{f.name: getattr(report, f.name) for f in fields(WorkerReport)})

    def merged(self, other: WorkerReport) -> Self:
        """Both reports' outcomes, added up (two ranks, or two steps)."""
        return type(self)(
            self.host_stored + other.host_stored, self.host_failed + other.host_failed,
            self.disk_written + other.disk_written, self.disk_failed + other.disk_failed,
            {req: self.load_failed.get(req, set()) | other.load_failed.get(req, set())
             for req in self.load_failed.keys() | other.load_failed.keys()},
            self.paths_down + other.paths_down,
            self.load_samples + other.load_samples, self.loads_done + other.loads_done,
            self.paths_up + other.paths_up, self.reads_stalled + other.reads_stalled,
            self.reads_over + other.reads_over,
            self.remote_written + other.remote_written, self.remote_failed + other.remote_failed,
            {req: max(self.load_seconds.get(req, 0.0), other.load_seconds.get(req, 0.0))
             for req in self.load_seconds.keys() | other.load_seconds.keys()},
            self.verified + other.verified, self.verify_differed + other.verify_differed,
            self.verify_failed + other.verify_failed,
            {**self.remote_records, **other.remote_records},
            self.remote_absent | other.remote_absent,
            self.verify_undecided + other.verify_undecided,
            self.other_bad | other.other_bad,
            found_added(without_paths(self.paths_found, other.paths_down), other.paths_found),
            self.verify_skipped + other.verify_skipped,
        )

    def is_empty(self) -> bool:
        return not (self.host_stored or self.host_failed or self.disk_written
                    or self.disk_failed or self.load_failed or self.paths_down
                    or self.load_samples or self.loads_done or self.paths_up
                    or self.reads_stalled or self.reads_over or self.remote_written
                    or self.remote_failed or self.load_seconds or self.verified
                    or self.verify_differed or self.verify_failed or self.remote_records
                    or self.remote_absent or self.verify_undecided or self.other_bad
                    or self.paths_found or self.verify_skipped)


def without_paths(found: dict, paths: Iterable[int]) -> dict:
    """``paths_found`` but what was found on ``paths`` (each out of service again since:
    what it held is no longer vouched for)."""
    gone = set(paths)
    return {where: seen for where, seen in found.items() if where[0] not in gone} if gone else found


def found_added(one: dict, other: dict) -> dict:
    """Two ranks' (or reports') ``paths_found``, added up: the larger copied, the other
    added to it."""
    if len(one) < len(other):
        one, other = other, one
    both = dict(one)
    for where, (ranks, generation) in other.items():
        had = both.get(where)
        both[where] = (ranks, generation) if had is None else (had[0] + ranks, min(had[1], generation))
    return both
