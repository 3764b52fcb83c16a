"""A writer's lease on its segment of a shared cache directory: a small file it rewrites every
few seconds (a heartbeat), and how a reader tells a live writer from one that is gone.

Liveness never relies on clocks agreeing between machines, nor on ``flock`` (which some
network filesystems do not honour across machines): a reader notes, on its own monotonic
clock, when it last saw a lease change (a process that looks once judges by file times
instead: ``kvtier.segment.lease_age``). A writer whose lease stood still for
``lease_timeout`` seconds is gone. A reader that has just started knows nothing yet, so a
writer counts as live until the reader has watched its lease stand still that long.

Engines on one directory may be configured with different timeouts. A lease therefore states
its writer's own ``lease_timeout`` (``timeout_ms``), and a reader waits the longer of its own
and the writer's before it counts the writer gone: a reader with a short timeout never takes a
writer that beats slowly, by its own setting, for dead.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

from kvtier.io.safefs import CacheDirError, SafeDir
from kvtier.segment import machine
from kvtier.segment.names import LEASE_FILE, host_name

MAX_LEASE_BYTES = 4096  # a lease is about 150 bytes; anything larger is not kvtier's
CLOSE_WAIT_S = 5.0  # how long a lease's closing beat waits for a beat under way

log = logging.getLogger("kvtier")


def beat_every(lease_timeout: float) -> float:
    """Seconds between two heartbeats for ``lease_timeout``: six beats fit in one timeout."""
    return max(0.1, lease_timeout / 6)


@dataclass(frozen=True)
class LeaseInfo:
    """What a lease file says: who writes the segment, on which machine, and its heartbeat
    count."""

    instance: str
    host: str
    pid: int
    beat: int
    started_ns: int
    written_ns: int  # the writer's wall clock: shown to people, never used for liveness
    ppid: int = 0  # the writing process's parent (a vLLM worker's: its engine core)
    timeout_ms: int = 0  # the writer's lease_timeout (0: not stated, by an older kvtier)
    closed_ns: int = 0  # when its writer closed the segment (0: open, or killed)
    pid_ns: int = 0  # the writer's PID namespace (``kvtier.segment.machine``; 0: not stated)
    boot_id: str = ""  # the writer's kernel's boot id ("": not stated, by an older kvtier)

    @property
    def beat_interval(self) -> float:
        """Seconds between its writer's beats, from its start time and beat count (both by
        its own clock); 0 after one beat."""
        return (self.written_ns - self.started_ns) / 1e9 / (self.beat - 1) if self.beat > 1 else 0.0

    def this_machine(self) -> bool:
        """Written on this machine, whose ``flock`` is seen here (``same_machine``)."""
        return machine.same_machine(self.boot_id, self.host)

    def this_pid_space(self) -> bool:
        """Its ``pid`` and ``ppid`` name processes as this process sees them
        (``same_pid_space``)."""
        return machine.same_pid_space(self.boot_id, self.host, self.pid_ns)

    def encode(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes | None) -> LeaseInfo | None:
        """The lease in ``data``, or None when it is missing or not a lease kvtier writes: a
        JSON object whose ``instance`` and ``host`` (and ``boot_id``, when there is one) are
        strings and whose counts are integers (not booleans, not floats) from 0 to
        ``MAX_LEASE_INT`` (exclusive). Never raises: a damaged lease reads as no lease."""
        if not data or len(data) > MAX_LEASE_BYTES:
            return None
        try:
            fields = json.loads(data)
            if not isinstance(fields, dict):
                return None
            instance, host, boot = fields["instance"], fields["host"], fields.get("boot_id", "")
            counts = [fields[name] for name in _COUNTS] + [fields.get(name, 0) for name in _OPTIONAL]
        except (ValueError, TypeError, KeyError, RecursionError, OverflowError):
            return None
        if not all(isinstance(text, str) for text in (instance, host, boot)) \
                or not all(_is_count(value) for value in counts):
            return None
        return replace(cls(instance, host, *counts), boot_id=boot)


_COUNTS = ("pid", "beat", "started_ns", "written_ns")  # LeaseInfo's order, then _OPTIONAL
_OPTIONAL = ("ppid", "timeout_ms", "closed_ns", "pid_ns")  # an older kvtier may not write these: 0
MAX_LEASE_INT = 1 << 63  # a pid, a beat count or a time in ns is far below: more is damage


REMOTE_LEASE_S = 120.0  # the default lease_timeout: a writer elsewhere beats well within it
MAX_STATED_TIMEOUT_S = 86400.0  # the largest lease_timeout kvtier accepts: more is not honoured


def _is_count(value: object) -> bool:
    """True for an ``int`` (not a bool) in ``[0, MAX_LEASE_INT)``: what a lease field holds."""
    return type(value) is int and 0 <= value < MAX_LEASE_INT


def read_lease(directory: SafeDir) -> LeaseInfo | None:
    """The lease of the segment open in ``directory`` (None when missing or not kvtier's)."""
    try:
        return LeaseInfo.parse(directory.read_file(LEASE_FILE, MAX_LEASE_BYTES))
    except OSError:
        return None


class LeaseLost(CacheDirError):
    """This writer may not write its segment any more: its path goes out of service."""


class SeatLost(LeaseLost):
    """This writer's seat is gone while it writes (given back by a reclaim or as an orphan
    in a race with this writer's restart): writing on would make one segment more than
    ``share_writers``. The path's next try claims a seat afresh."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.EAGAIN, f"the writer of {path} holds no seat any more (given "
                         "back by another process); it claims one again at the path's next try")


class LeaseConflict(LeaseLost):
    """Another process rewrote this writer's lease: two writers write one segment (one
    ``instance_id`` given to two engines, on a filesystem that does not pass ``flock`` on
    between machines)."""

    def __init__(self, path: str, other: LeaseInfo) -> None:
        super().__init__(errno.EBUSY, f"{path} is written by another process under the same "
                         f"writer id ({other.instance}: host {other.host}, pid {other.pid}); "
                         "give each engine its own instance_id")
        self.other = other


class Lease:
    """The lease a writer holds on one segment: ``beat()`` rewrites it (atomically: a new file
    renamed over the old), one count higher each time. ``timeout`` is the writer's
    ``lease_timeout``, stated in the lease for readers configured otherwise.

    Before each beat after the first, the lease is read back: when another process wrote it
    since (``LeaseConflict``), nothing is written, and the writer's path goes out of service
    (``LeaseKeeper``'s ``on_conflict``) rather than two writers sharing one segment. So it
    does when ``seated()`` says the writer's seat is gone (``SeatLost``). A lease
    gone (a reclaim) is no conflict: the path's own checks see the segment gone. Beats
    of one lease run one at a time; once ``close`` ran, none is written. Thread-safe."""

    def __init__(self, directory: SafeDir, instance: str, timeout: float,
                 seated: Callable[[], bool] | None = None,
                 held: Callable[[], AbstractContextManager[None]] = nullcontext) -> None:
        self._directory, self._seated, self._held = directory, seated, held
        self._info = LeaseInfo(instance, host_name(), os.getpid(), 0, time.time_ns(), 0,
                               os.getppid(), round(timeout * 1000), 0, machine.pid_namespace(),
                               machine.boot_id())
        self._beating = threading.Lock()  # one beat at a time, the closing one last
        self._closed = False

    @property
    def path(self) -> str:
        """The segment's directory, for messages."""
        return self._directory.path

    def beat(self) -> None:
        """Rewrite the lease (``OSError`` EBADF once closed; see the class docstring)."""
        with self._beating:
            self._beat_held(closing=False)

    def _beat_held(self, closing: bool) -> None:
        with self._held():  # the directory's descriptor stays its own meanwhile
            if self._closed:
                raise OSError(errno.EBADF, f"the lease of {self.path} was closed")
            self._beat(closing)

    def _beat(self, closing: bool) -> None:
        if self._info.beat:
            current = read_lease(self._directory)
            if current is not None and not self._is_mine(current):
                raise LeaseConflict(self._directory.path, current)
            if not closing and self._seated is not None and not self._seated():
                raise SeatLost(self._directory.path)
        now = time.time_ns()
        info = replace(self._info, beat=self._info.beat + 1, written_ns=now,
                       closed_ns=now if closing else 0)
        self._directory.replace_file(LEASE_FILE, info.encode())
        self._info = info  # only once written: a failed beat is no conflict at the next

    def _is_mine(self, lease: LeaseInfo) -> bool:
        """Written by this lease's writer (whatever beat: a write that failed half-way)."""
        mine = self._info
        return (lease.instance, lease.host, lease.boot_id, lease.pid, lease.started_ns) == (
            mine.instance, mine.host, mine.boot_id, mine.pid, mine.started_ns)

    def close(self) -> None:
        """The last beat, saying the writer closed the segment: a writer of another machine
        may take the id at once. Nothing is written when another process wrote the lease
        since, or the segment is gone, or a beat under way has not returned within
        ``CLOSE_WAIT_S`` (a hung filesystem: the lease then stands still, and readers take
        the writer for gone after their ``lease_timeout``); never raises. No beat follows."""
        if not self._beating.acquire(timeout=CLOSE_WAIT_S):
            self._closed = True
            log.debug("kvtier: lease of %s not closed: a beat of it has not returned", self.path)
            return
        try:
            self._beat_held(closing=True)
        except OSError as exc:
            log.debug("kvtier: lease not closed: %s", exc)
        finally:
            self._closed = True
            self._beating.release()


def stated_timeout(data: bytes | None) -> float:
    """The ``lease_timeout`` in seconds that the lease in ``data`` states (0 when none, or
    when its writer closed the segment: nothing beats any more), at most
    ``MAX_STATED_TIMEOUT_S``."""
    lease = LeaseInfo.parse(data)
    if lease is None or lease.closed_ns:
        return 0.0
    return min(lease.timeout_ms / 1000, MAX_STATED_TIMEOUT_S)


@dataclass
class _Seen:
    data: bytes | None
    since: float  # monotonic time the lease was last seen to change (or first seen)
    timeout: float  # the longer of the reader's lease_timeout and the one the lease states


class LeaseWatch:
    """A reader's view of other writers' leases.

    ``observe(name, data)`` records what writer ``name``'s lease file held just now (None when
    missing) and returns whether that writer is live: its lease changed within the longer of
    ``timeout`` and the writer's own stated timeout, by this reader's clock, or this reader
    has not watched it that long yet. A lease file that vanished is no heartbeat.
    """

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout, self._clock = timeout, clock
        self._seen: dict[str, _Seen] = {}

    def observe(self, name: str, data: bytes | None) -> bool:
        now = self._clock()
        seen = self._seen.get(name)
        if seen is None or (seen.data != data and data is not None):  # gone is no heartbeat
            timeout = max(self.timeout, stated_timeout(data))
            self._seen[name] = seen = _Seen(data, now, timeout)
        return now - seen.since < seen.timeout

    def live(self, name: str) -> bool:
        """Whether writer ``name`` counted as live at its last ``observe`` (True: never seen)."""
        seen = self._seen.get(name)
        return seen is None or self._clock() - seen.since < seen.timeout

    def idle_for(self, name: str) -> float | None:
        """Seconds since writer ``name``'s lease was last seen to change (None: never seen)."""
        seen = self._seen.get(name)
        return None if seen is None else self._clock() - seen.since

    def forget(self, name: str) -> None:
        self._seen.pop(name, None)
