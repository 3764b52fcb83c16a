"""Watching the lease of another machine's writer before a command changes its segment.

File times tell a lease's age by the filesystem's clock (``kvtier.segment.lease_age``). Where
the filesystem's clients set file times themselves (Lustre, GPFS) that clock is the writer's
own, and a live writer whose clock runs behind this one would look gone. So before ``gc``,
``clear`` or ``verify --repair`` changes a segment whose lease another machine's writer did
not close, and which file times call gone, its lease is read once more two of that writer's
heartbeat intervals after this process first read it (``watch_span``): a lease that changed
meanwhile is a live writer's, and the segment is in use. No clock is read but this
process's monotonic one.

A command notes every lease it may change before it changes any (``note_lease``, after
``LOOKS.forget()``: what an earlier command of this process saw counts no more), so that it
waits once for all of them, not once per segment (``LeaseLooks``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.io.safefs import SafeDir
from kvtier.segment.lease import MAX_LEASE_BYTES, REMOTE_LEASE_S, LeaseInfo, beat_every
from kvtier.segment.lease_age import written_elsewhere
from kvtier.segment.names import LEASE_FILE

MAX_WATCH_S = 60.0  # a command waits no longer for a writer that beats more slowly


def watch_span(lease: LeaseInfo) -> float:
    """Seconds a lease is watched: two of its writer's heartbeat intervals (a sixth of the
    ``lease_timeout`` it states; else from its start time and beat count, both by its own
    clock; else those of the default ``lease_timeout``), at most ``MAX_WATCH_S``."""
    if lease.timeout_ms:
        every = beat_every(lease.timeout_ms / 1000)
    elif lease.beat > 1:
        every = max(0.1, lease.beat_interval)
    else:
        every = beat_every(REMOTE_LEASE_S)
    return min(2 * every, MAX_WATCH_S)


@dataclass
class _Look:
    data: bytes | None
    since: float  # this process's monotonic time when it first read ``data``


class LeaseLooks:
    """Contract: ``note(key, data)`` records what the lease of segment ``key`` held when this
    process first read it (kept while the lease holds the same); ``changed(key, read,
    span)`` says whether it changed within ``span`` seconds of being watched: it waits out
    what is left of ``span`` since the note (noting it now when it was not), then reads it
    once more with ``read`` and compares. A change seen starts the watch afresh; ``forget``
    starts every watch afresh."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._clock, self._sleep = clock, sleep
        self._seen: dict[tuple[str, int, int], _Look] = {}

    def forget(self) -> None:
        self._seen.clear()

    def note(self, key: tuple[str, int, int], data: bytes | None) -> None:
        if key not in self._seen:
            self._seen[key] = _Look(data, self._clock())

    def changed(self, key: tuple[str, int, int], read: Callable[[], bytes | None],
                span: float) -> bool:
        self.note(key, read())
        look = self._seen[key]
        left = look.since + span - self._clock()
        if left > 0:
            self._sleep(left)
        data = read()
        if data == look.data:
            return False
        self._seen[key] = _Look(data, self._clock())
        return True


LOOKS = LeaseLooks()  # what this process saw of the leases of other machines' writers


def _key(directory: SafeDir) -> tuple[str, int, int]:
    info = os.fstat(directory.fd)
    return directory.path, info.st_dev, info.st_ino


def _read(directory: SafeDir) -> bytes | None:
    try:
        return directory.read_file(LEASE_FILE, MAX_LEASE_BYTES)
    except OSError:
        return None


def note_lease(directory: SafeDir, looks: LeaseLooks = LOOKS) -> None:
    """Note the lease of the segment open in ``directory`` when another machine's writer has
    not closed it: the watch before a change (``changed_while_watched``) counts from now."""
    data = _read(directory)
    if written_elsewhere(LeaseInfo.parse(data)):
        looks.note(_key(directory), data)


def changed_while_watched(directory: SafeDir, looks: LeaseLooks = LOOKS) -> str:
    """Why the segment open in ``directory`` is in use by the watch of its lease ("" when
    not, or when no other machine's writer left it open): the lease changed within
    ``watch_span`` of this process's first reading of it (waited out when not yet past)."""
    lease = LeaseInfo.parse(_read(directory))
    if lease is None or not written_elsewhere(lease):
        return ""
    span = watch_span(lease)
    if not looks.changed(_key(directory), lambda: _read(directory), span):
        return ""
    return f"its lease, written by {lease.host} (pid {lease.pid}), changed while watched for {span:.1f} s"
