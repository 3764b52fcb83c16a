"""A remote tier's I/O threads: its reads, and its puts as group commits (the chunks queued
while the threads are busy go together, in one pipelined ``put_many`` of up to the tier's
``put_group_bytes``). Every job is
tracked, so that ``drain`` and ``close`` can wait for them all: they read from and write
into host slots."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.io.batch_writes import Settle, WriteGroup, WriteGroups
from kvtier.io.guarded import started_pool, submit_guarded
from kvtier.io.in_flight import InFlight
from kvtier.io.result import IOResult
from kvtier.keys import ChunkKey
from kvtier.remote.base import RemoteTier

PUT_JOBS = 2  # put jobs running at once; the rest of the threads read
IN_FLIGHT_BYTES = 256 * 2**20  # writes in flight at most (and half the host slots)


def writes_in_flight(host_slots: int, chunk_bytes: int) -> int:
    """The remote writes a store or an engine keeps in flight at most, each pinning its
    host slot: half the host slots, ``IN_FLIGHT_BYTES`` at most, one at least."""
    return max(1, min(host_slots // 2, IN_FLIGHT_BYTES // max(1, chunk_bytes)))


@dataclass(frozen=True)
class RemotePut:
    """Write the chunk ``key`` held in host slot ``slot`` to the remote store."""

    key: ChunkKey
    slot: int


class RemoteLane:
    """The threads of one remote tier.

    Contract: ``submit(job)`` runs ``job`` on a remote thread (``RuntimeError`` once closed);
    ``put(item)`` queues a ``RemotePut`` (never blocks, calls nothing back: the caller may
    hold its locks) and returns its future and the group to ``start`` once no lock is held,
    if it opened one; a put job reads each chunk's bytes with ``payload(slot)`` and, once
    the store answered, calls ``settle(items, results)`` (results None: never run, the lane
    closed). ``puts_pending`` counts the puts queued or running (back-pressure).
    ``drain(timeout)`` waits for every job submitted so far; ``close(timeout)`` lets the puts
    queued go out, stops taking jobs, waits at most ``timeout`` in all, and closes the tier
    when none is left running (False: some still run and use host memory, which must stay
    allocated).
    """

    def __init__(self, tier: RemoteTier, threads: int, payload: Callable[[int], np.ndarray],
                 settle: Settle[RemotePut]) -> None:
        self.tier = tier
        self._payload = payload
        # reads have ``threads`` of their own beside the put jobs
        self._pool = started_pool(threads + PUT_JOBS, "kvtier-remote")  # none to start in a step
        self._lock = threading.Lock()
        self._jobs = InFlight()
        self.closed = False
        per_group = max(1, tier.put_group_bytes // max(1, tier.raw_bytes))
        self._puts = WriteGroups(self.submit, self._put_group, settle, per_group, PUT_JOBS,
                                 lambda: self.closed)

    def submit(self, job: Callable[[], Any]) -> Future:
        with self._lock:
            if self.closed:
                raise RuntimeError("the remote tier is closed")
            future: Future = Future()
            over = self._jobs.add(future)
            # a job whose submit raises never runs late
            return submit_guarded(self._pool, job, future=future, over=over)

    def put(self, item: RemotePut) -> tuple[Future[IOResult], WriteGroup[RemotePut] | None]:
        return self._puts.add(item)

    def start(self, group: WriteGroup[RemotePut] | None) -> None:
        """Submit the job of a group ``put`` opened, if any (lock not held)."""
        if group is not None:
            self._puts.start(group)

    @property
    def puts_pending(self) -> int:
        return self._puts.pending

    def _put_group(self, items: Sequence[RemotePut]) -> list[IOResult]:
        raw = self.tier.raw_bytes
        return self.tier.put_many([(item.key, self._payload(item.slot)[:raw]) for item in items])

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for the jobs submitted so far (and the puts they take on); True when over."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._jobs.count():  # a job over may have submitted another (the puts waiting)
            if not self._jobs.drain(None if deadline is None else deadline - time.monotonic()):
                return False
        return True

    def close(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        self.drain(timeout)  # still open: the puts waiting for a job go out too
        with self._lock:
            self.closed = True
        drained = self.drain(max(0.0, deadline - time.monotonic()))
        self._pool.shutdown(wait=False, cancel_futures=True)
        if drained:
            self.tier.close()
        return drained
