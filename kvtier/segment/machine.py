"""Which machine a process runs on, as its lease records it, and whether a lease was written on
this one.

A host name says neither: hosts, or containers, may be given one name. The kernel's boot id
(``/proc/sys/kernel/random/boot_id``, a random id drawn at each boot) is equal exactly for
processes that share a kernel, so exactly for those that see one another's ``flock``. Process
ids name one process only within one PID namespace of one kernel: containers sharing a
kernel each have their own, whose numbers overlap. A lease of an older kvtier records
neither, and is told by its host name (and its process ids taken as this namespace's).
"""

from __future__ import annotations

import functools
import os
import re
import time

from kvtier.segment.names import host_name

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
PID_NAMESPACE = "/proc/self/ns/pid"
_BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@functools.cache
def boot_id() -> str:
    """This kernel's boot id ("" when it cannot be read: then leases are told by host name)."""
    try:
        with open(BOOT_ID_FILE, "rb") as file:
            text = file.read(64).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return text if _BOOT_ID.fullmatch(text) else ""


@functools.cache
def pid_namespace() -> int:
    """The inode number of this process's PID namespace (0 when it cannot be read)."""
    try:
        return os.stat(PID_NAMESPACE).st_ino
    except OSError:
        return 0


def uptime_s() -> float | None:
    """Seconds since this kernel booted (None where it cannot be read)."""
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):  # not Linux
        return None


def same_machine(lease_boot_id: str, lease_host: str) -> bool:
    """Whether a lease recording ``lease_boot_id`` and ``lease_host`` was written on this
    machine (this kernel: its ``flock`` is seen here): by boot id, or by host name where the
    lease has none (an older kvtier) or this kernel's cannot be read."""
    mine = boot_id()
    if lease_boot_id and mine:
        return lease_boot_id == mine
    return lease_host == host_name()


def same_pid_space(lease_boot_id: str, lease_host: str, lease_pid_ns: int) -> bool:
    """Whether the process ids of a lease recording these name processes as this process sees
    them: written on this machine (``same_machine``), in this PID namespace where the lease
    records one."""
    if not same_machine(lease_boot_id, lease_host):
        return False
    mine = pid_namespace()
    return not (lease_pid_ns and mine) or lease_pid_ns == mine
