"""Starting the reads of a ``get``'s fetches: grouped per disk path (this store's slots apart
from other writers') or per round trip to the remote store, each group one job, every fetch
given its read whatever fails."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from kvtier.io.batch_reads import READ_GROUP_BYTES, ReadGroup, start_groups
from kvtier.io.result import IOResult, IOStatus
from kvtier.store.fetch import Fetch, FetchState
from kvtier.store.state import REMOTE, StoreState


class ReadJobs:
    """The read jobs of one store's gets."""

    def __init__(self, state: StoreState) -> None:
        self.state = state

    def start(self, fetches: list[Fetch]) -> None:
        """Start the disk reads of fetches ``begin`` reserved: a job per path and group of
        up to ``READ_GROUP_BYTES`` (neighbouring slots move in one call; small chunks read
        one by one lose more to the hand-offs between threads than they gain in
        parallel). Every fetch gets its read, whatever fails."""
        reading = sorted((f for f in fetches if f.state is FetchState.READING and f.read is None),
                         key=Fetch.order)
        if not reading:
            return
        timeout = self.state.config.load_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        from_remote = [f for f in reading if f.tier is REMOTE]
        reading = [f for f in reading if f.tier is not REMOTE]
        try:
            self._start_disk(reading, deadline)
        finally:  # every fetch gets its read, whatever fails
            if from_remote:
                self._start_remote(from_remote, deadline)

    def _start_disk(self, reading: list[Fetch], deadline: float | None) -> None:
        lane = self.state.lane
        per_group = max(1, READ_GROUP_BYTES // self.state.transfers.chunk_bytes)
        groups: list[ReadGroup] = []
        fetches: list[Fetch] = []
        for i, queue in enumerate(lane.queues):
            for theirs in (False, True):  # a group reads this store's slots or other writers'
                mine = [f for f in reading
                        if self._queue_index(f) == i and (f.other is not None) == theirs]
                for first in range(0, len(mine), per_group):
                    group = mine[first:first + per_group]
                    groups.append(ReadGroup(len(group), self._reader(group),
                                            partial(lane.submit, queue)))
                    fetches += group
        self._start(groups, fetches, deadline)

    def _start_remote(self, fetches: list[Fetch], deadline: float | None) -> None:
        """Start the reads of chunks from the remote store, a job (one round trip) per
        group of up to the tier's ``read_group_bytes``."""
        remote = self.state.remote
        assert remote is not None, "chunks come from the remote store only with one"
        per_group = max(1, remote.tier.read_group_bytes // self.state.transfers.chunk_bytes)
        groups = []
        for first in range(0, len(fetches), per_group):
            pairs = [(f.key, f.plan.dst.slot) for f in fetches[first:first + per_group]
                     if f.plan is not None]
            groups.append(ReadGroup(len(pairs), partial(remote.get, pairs), remote.lane.submit))
        self._start(groups, fetches, deadline)

    @staticmethod
    def _start(groups: list[ReadGroup], fetches: list[Fetch], deadline: float | None) -> None:
        """Start the groups (``start_groups``), each fetch given its read; a lane that refused
        one (the store closed meanwhile) is raised once every fetch has its read."""
        started = start_groups(groups)
        for fetch, read in zip(fetches, started.reads, strict=True):
            fetch.read, fetch.deadline = read, deadline
        if started.refused is not None:
            raise started.refused

    def _queue_index(self, fetch: Fetch) -> int:
        """The disk path a fetch reads from (another writer's chunks: the same path)."""
        paths = len(self.state.lane.queues)
        return (fetch.other[0].path if fetch.other else fetch.loc.slot) % paths

    def _reader(self, group: list[Fetch]) -> Callable[[], list[IOResult]]:
        """The read of one group: from this store's disk slots or from another writer's."""
        if group[0].other is not None:
            others = self.state.others
            assert others is not None, "chunks of other writers come from their followers"
            host = self.state.transfers.host_array
            pairs = [(f.other, host(f.plan.dst)) for f in group if f.other and f.plan]
            return partial(others.read_many, pairs)
        items = [(f.key, f.loc, f.target()) for f in group]
        return partial(self._read_and_blank, items)

    def _read_and_blank(self, items: list) -> list[IOResult]:
        """Verified disk reads (an I/O thread); a corrupt slot's header is blanked in the
        same job, so a get's wait on it is bounded by ``load_timeout`` like the read's, and
        the slot stays pinned until both are over."""
        results = self.state.transfers.read_many(items)
        for (_, loc, _), result in zip(items, results, strict=True):
            if result.status is IOStatus.CORRUPT:
                self.state.lane.invalidate(loc.slot)
        return results
