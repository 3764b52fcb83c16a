"""How old a lease is, and whether it shows a live writer on another machine, as a process that
looks once judges it (an engine opening a segment, the offline commands): by file times,
never by the time a lease states (``written_ns``, its writer's wall clock, which need not
agree with this machine's).

A lease file's modification time is set as its writer writes it, by the clock that sets the
filesystem's file times: the file server's on NFS, the kernel's on a local disk. That clock
is read now from a file made for the purpose beside it (``filesystem_now_ns``), and the
difference is the lease's age, whatever the clocks of the writer's machine and of this one
say. Where a filesystem's clients set file times themselves (Lustre, GPFS) the age is only
as good as their clocks agree: a command that changes a segment watches its lease as well
(``kvtier.ops.liveness``), and engines watch leases on their own monotonic clock
(``LeaseWatch``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable

from kvtier.io.safefs import SafeDir
from kvtier.segment.lease import (
    MAX_STATED_TIMEOUT_S,
    REMOTE_LEASE_S,
    LeaseInfo,
    beat_every,
    read_lease,
)
from kvtier.segment.machine import uptime_s
from kvtier.segment.names import LEASE_FILE, host_name


def filesystem_now_ns(directory: SafeDir) -> int | None:
    """``read_filesystem_clock``; None when no file can be made in ``directory``."""
    try:
        return read_filesystem_clock(directory)
    except OSError:
        return None


def read_filesystem_clock(directory: SafeDir) -> int:
    """The time now by the clock that sets file times in ``directory``: the change time of a
    new file made there (``.clock_probe-<pid>-<8 hex>``, a ``TEMP_NAME``), removed at once:
    set as it is made, and never from a client's request, unlike a modification time (an
    NFS exclusive create stores a verifier there for a moment); ``OSError`` when none can be
    made (a read-only mount, a directory not writable, a full disk)."""
    name = f".clock_probe-{os.getpid()}-{secrets.token_hex(4)}"
    fd = directory.open_file(name, os.O_WRONLY | os.O_EXCL, create=True)
    try:
        return os.fstat(fd).st_ctime_ns
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            directory.remove_file(name)


def written_elsewhere(lease: LeaseInfo | None) -> bool:
    """Whether ``lease`` is one another machine's writer has not closed: it says nothing
    about a writer of this machine (``LeaseInfo.this_machine``), whose lock tells instead
    (``flock`` works within one machine)."""
    return lease is not None and not lease.closed_ns and not lease.this_machine()


def held_elsewhere(lease: LeaseInfo | None, age: float | None) -> str:
    """Why ``lease`` shows a writer on another machine that may be alive ("" when not): it
    was not closed and was written, ``age`` seconds ago by the filesystem's clock (None:
    not known, so it may be alive), less than ``REMOTE_LEASE_S`` ago, less than the
    ``lease_timeout`` it states, or less than six of the writer's own heartbeat intervals
    (from its start time and beat count, both by its own clock) ago; never more than a day.
    A lease dated more than ``REMOTE_LEASE_S`` ahead shows no live writer (a forged date, or
    a client's clock that far off where clients set file times): it would hold the segment
    until the clock caught up. A writer of this machine is told by its lock instead
    (``written_elsewhere``)."""
    if not written_elsewhere(lease):
        return ""
    assert lease is not None, "written_elsewhere said it is a lease"
    who = f"its lease was written by {lease.host} (pid {lease.pid})"
    if age is None:
        return (f"{who} and not closed, and its age cannot be told without the filesystem's "
                "clock, read from a file made for the purpose: none was made (a read-only "
                "mount, a full disk, or a directory not proven kvtier's)")
    every = lease.beat_interval
    live_for = min(max(6 * every, lease.timeout_ms / 1000), MAX_STATED_TIMEOUT_S)  # a day at most
    if age >= max(REMOTE_LEASE_S, live_for) or age < -REMOTE_LEASE_S:
        return ""
    if lease.host == host_name() and _before_this_boot(age, every or beat_every(lease.timeout_ms / 1000)):
        return ""  # this host's writer before it restarted: gone with that kernel
    return f"{who} {max(age, 0.0):.0f} s ago"


def _before_this_boot(age: float, every: float) -> bool:
    """Whether a lease ``age`` seconds old was last written before this kernel booted, and
    more than two of its writer's heartbeats (``every``) ago: a live writer on another
    machine of this host name would have written it since."""
    uptime = uptime_s()
    return uptime is not None and age > max(uptime, 2 * every) + 1.0


def remote_holder(directory: SafeDir, clock: Callable[[], int | None] | None = None) -> str:
    """``held_elsewhere`` for the lease of the segment open in ``directory``, its age its
    modification time against the filesystem's clock, read with ``clock`` (None: not known;
    by default ``filesystem_now_ns``, a file made in ``directory``: an engine's own segment),
    and only for a lease another machine's writer has not closed. The clock is read before
    the lease's time: an age is never overstated."""
    lease = read_lease(directory)
    if not written_elsewhere(lease):
        return ""
    now = filesystem_now_ns(directory) if clock is None else clock()
    info = directory.lstat(LEASE_FILE)
    if info is None:
        return ""  # removed since it was read: no lease shows no writer
    assert lease is not None, "written_elsewhere said it is a lease"
    if now is None and dated_here(lease):  # no file can be made: its stated time, one clock
        return held_elsewhere(lease, (time.time_ns() - lease.written_ns) / 1e9)
    return held_elsewhere(lease, None if now is None else (now - info.st_mtime_ns) / 1e9)


def dated_here(lease: LeaseInfo) -> bool:
    """Whether ``lease`` states its time by this machine's clock: written by this kernel.
    (Not a lease of this host name and another boot: another machine may bear the name,
    and its clock need not agree with this one's.)"""
    return lease.this_machine()
