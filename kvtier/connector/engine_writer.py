"""Which writer id an engine's segments go under, as its scheduler side finds out.

The workers choose: each rank opens the first writer id of ``writer_ids(instance_id)`` whose
segment no running process of this host holds, and leases it under its own pid and its
parent's. vLLM sets the workers up (and so their disk tiers) before the scheduler, in the
engine core process that is either the workers' own or their parent; the scheduler side
then takes, for each rank, the segment whose lock is held and whose lease names its process
(a worker in it), else one whose lease names it as the parent (a worker process of it).
"""

from __future__ import annotations

import os

from kvtier.config import KVTierConfig
from kvtier.io.lease import LeaseInfo, read_lease
from kvtier.io.names import WRITER_ID, WRITERS_DIR, host_name, writer_ids
from kvtier.io.safefs import SafeDir
from kvtier.io.seats import held_here
from kvtier.keys import Namespace


def engine_writers(config: KVTierConfig, namespaces: list[Namespace]) -> list[str | None]:
    """The writer id of each rank's segments: ``instance_id`` when set; else the one this
    engine's workers hold; else the first default when no process of this host holds it
    (the workers would have taken it); else None: not known, and the scheduler side must not
    take any segment's index for its own."""
    if config.instance_id:
        return [config.instance_id] * len(namespaces)
    return [_this_engines(config.disk_paths, ns) for ns in namespaces]


def _this_engines(roots: tuple[str, ...], namespace: Namespace) -> str | None:
    """A segment held by a worker in this process, else by a child of it, else see
    ``engine_writers``."""
    held = _held_here(roots, namespace)
    me = os.getpid()
    for found in ([n for n, lease in held if lease.pid == me],
                  [n for n, lease in held if lease.ppid == me]):
        if found:
            return found[0]
    first = writer_ids(None)[0]
    return None if any(name == first for name, _ in held) else first


def _held_here(roots: tuple[str, ...], namespace: Namespace) -> list[tuple[str, LeaseInfo]]:
    """The segments of ``namespace`` whose lock a process of this host holds, with their
    leases."""
    found, host = [], host_name()
    for root in roots:
        try:
            with SafeDir.open(root) as top, top.subdir(namespace.id) as ns_dir, \
                    ns_dir.subdir(WRITERS_DIR) as writers:
                for name in writers.names():
                    if not WRITER_ID.fullmatch(name):
                        continue
                    try:
                        with writers.subdir(name) as segment:
                            lease = read_lease(segment)
                            if lease is not None and lease.host == host and held_here(segment):
                                found.append((name, lease))
                    except OSError:
                        continue
        except OSError:
            continue
    return found
