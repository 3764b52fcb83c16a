"""Which writer id an engine's segments go under, as its scheduler side finds out.

The workers choose: each rank opens the first writer id of ``writer_ids(instance_id)`` whose
segment no running process of this host holds, and leases it under its own pid and its
parent's. vLLM sets the workers up (and so their disk tiers) before the scheduler, in the
engine core process that is either the workers' own or their parent; the scheduler side
then takes, for each rank, the segment whose lock is held and whose lease names its process
(a worker in it), else one whose lease names it as the parent (a worker process of it).
A lease's process ids count only when it was written in this process's PID namespace of
this kernel (``LeaseInfo.this_pid_space``): machines, or containers, that share a host name
number their processes each in their own way, and the same pid there is another process.

So that every rank of an engine writes under one id even when engines of one host start at
the same time, a rank other than 0 first looks for the id its rank 0 took
(``leaders_writer``: a sibling worker process's segment of rank 0's namespace) and tries it
first.

The scheduler side's view of the other engines passes over only the segments its workers
hold, or are about to take (``EngineSegments``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from kvtier.config.settings import KVTierConfig
from kvtier.io.answers import answers, ask
from kvtier.io.bounded_jobs import path_job_wait
from kvtier.io.root_looks import look_at_roots
from kvtier.io.safefs import SafeDir
from kvtier.keys import Namespace
from kvtier.segment.lease import LeaseInfo, read_lease
from kvtier.segment.lock import locked_here
from kvtier.segment.names import WRITERS_DIR, default_writer_ids, host_name, writer_ids
from kvtier.shared.followed import OwnSegments


def engine_writers(config: KVTierConfig, namespaces: list[Namespace]) -> list[str | None]:
    """The writer id of each rank's segments: ``instance_id`` when set; else the one this
    engine's workers hold; else the first default when no process of this host holds it
    (the workers would have taken it); else None: not known, and the scheduler side must not
    take any segment's index for its own."""
    if config.instance_id:
        return [config.instance_id] * len(namespaces)
    wait = path_job_wait(config.load_timeout)
    return [_this_engines(answering(config), ns, wait) for ns in namespaces]


def answering(config: KVTierConfig) -> tuple[str, ...]:
    """The disk paths whose file systems answer within ``load_timeout`` (not a hung mount:
    ``kvtier.io.answers``); a path that does not holds no segment to be found."""
    ask(config.disk_paths, config.load_timeout)  # every path at once: hung ones cost one wait
    return tuple(root for root in config.disk_paths if answers(root, config.load_timeout))


def _this_engines(roots: tuple[str, ...], namespace: Namespace, wait: float | None) -> str | None:
    """``workers_writer``, else see ``engine_writers``."""
    workers, unheld = _look(roots, namespace, wait)
    return workers or unheld


def _look(roots: tuple[str, ...], namespace: Namespace,
          wait: float | None) -> tuple[str | None, str | None]:
    """``workers_writer``'s answer, and the first default writer id when no process of this
    host holds its segment of ``namespace`` (the workers would take it; else None), from one
    look at each default id (a path whose look is not over within ``wait`` may hold it: not
    known)."""
    if not roots:  # none looked at (none answered): nothing is known of any id
        return None, None
    first = writer_ids(None)[0]
    held, whole = _held_here(roots, namespace, lambda name, lease: name == first or _ours(lease),
                             wait)
    unheld = None if not whole or any(name == first for name, _, _ in held) else first
    return _workers_among(held), unheld


def workers_writer(roots: tuple[str, ...], namespace: Namespace,
                   wait: float | None = None) -> str | None:
    """The default writer id of a segment of ``namespace`` held by a worker in this process,
    else by a child of it (its lease says so, written in this PID namespace); None when no
    worker of this engine holds one. Only such segments have their lock tried."""
    return _workers_among(_held_here(roots, namespace, lambda name, lease: _ours(lease), wait)[0])


def _ours(lease: LeaseInfo) -> bool:
    """Written by this process or a child of it, in this PID namespace."""
    return lease.this_pid_space() and os.getpid() in (lease.pid, lease.ppid)


def _workers_among(found: list[tuple[str, LeaseInfo, bool]]) -> str | None:
    """``workers_writer``'s answer among what ``_held_here`` found."""
    me = os.getpid()
    held = [(n, lease) for n, lease, sure in found if sure and _ours(lease)]
    for ids in ([n for n, lease in held if lease.pid == me],
                [n for n, lease in held if lease.ppid == me]):
        if ids:  # only a lock surely held: a lock that cannot be tried proves nobody's
            return ids[0]
    return None


class EngineSegments:
    """The segments a scheduler side's view of the other engines passes over as this
    engine's own (``OtherWriters``' ``own``).

    Contract: calling it returns, for each rank (``namespaces``), the writer id of its
    segments on each disk path: ``instance_id`` when set; else the one this engine's
    workers hold (``workers_writer``), looked for again at each call until found, then kept
    (a worker keeps its id). Until then, the id the workers are about to take, when no
    process of this host holds it (the first default: a scheduler side made before its
    workers opened their segments), else None, looked at anew at each call. So an engine
    whose workers hold no segment (every seat taken) follows every writer once another
    process holds the id where its workers stopped: that segment is read, never skipped as
    its own."""

    def __init__(self, config: KVTierConfig, namespaces: list[Namespace]) -> None:
        self._config, self._roots, self._namespaces = config, config.disk_paths, namespaces
        self._found: list[str | None] = [config.instance_id] * len(namespaces)
        self._wait = path_job_wait(config.load_timeout)

    def __call__(self) -> list[OwnSegments]:
        own = []
        for rank, namespace in enumerate(self._namespaces):
            writer = self._found[rank]
            if writer is None:  # one look at the default ids answers both
                self._found[rank], unheld = _look(answering(self._config), namespace, self._wait)
                writer = self._found[rank] or unheld
            own.append((writer,) * len(self._roots))
        return own


LEADER_WAIT_S = 10.0  # the ranks set their disk tiers up at about the same time


def leaders_writer(roots: tuple[str, ...], leader: Namespace, timeout: float = LEADER_WAIT_S,
                   parent: int | None = None, wait: float | None = None) -> str | None:
    """The writer id rank 0 of this engine holds: the one segment of ``leader`` (rank 0's
    namespace) held on this host whose lease names ``parent`` (default: this process's
    parent) as its writer's parent, from another process (a sibling worker) of this PID
    namespace (``LeaseInfo.this_pid_space``). Waited for up
    to ``timeout`` seconds (each look at a path ``wait``: ``_held_here``); None when there
    is not exactly one (the caller then takes the first id free, as rank 0 did)."""
    parent = os.getppid() if parent is None else parent
    deadline = time.monotonic() + timeout

    def sibling(name: str, lease: LeaseInfo) -> bool:
        return lease.this_pid_space() and lease.ppid == parent and lease.pid != os.getpid()

    while True:
        found = [name for name, _, sure in _held_here(roots, leader, sibling, wait)[0] if sure]
        if len(found) == 1:
            return found[0]
        if len(found) > 1 or time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def rank_writer_ids(config: KVTierConfig, namespace: Namespace,
                    leader: Namespace | None) -> list[str]:
    """The writer ids a worker tries, in order: ``writer_ids(instance_id)``, with rank 0's
    (``leaders_writer``; ``leader``: rank 0's namespace) first for a rank > 0."""
    ids = writer_ids(config.instance_id)
    if config.instance_id or leader is None or namespace.tp_rank == 0 or not config.disk_paths:
        return ids
    roots = answering(config)
    if not roots:  # no path answers: rank 0 holds no segment to be found, none is waited for
        return ids
    first = leaders_writer(roots, leader, wait=path_job_wait(config.load_timeout))
    return ids if first is None else [first, *[i for i in ids if i != first]]


def _held_here(roots: tuple[str, ...], namespace: Namespace,
               wanted: Callable[[str, LeaseInfo], bool], wait: float | None,
               ) -> tuple[list[tuple[str, LeaseInfo, bool]], bool]:
    """The segments of ``namespace`` under this host's default writer ids (the only ones its
    engines take without an ``instance_id``) whose lock a process of this host holds, or
    that cannot be told (``held_here``'s cautious answer), with their leases and whether the
    lock is surely held (a lock that cannot be opened, a directory say, is not); only those
    ``wanted`` (by id and lease) have their lock tried (a try takes the lock for a moment).
    Each id is looked up by name: ``writers/`` is not listed (other hosts' writers, or
    entries stuffed there, cost nothing). The paths are looked at together, each on a
    thread of its own, for ``wait`` seconds (``look_at_roots``: a mount that answered, then
    hung, holds none of its callers); also whether every path's look ended."""
    host = host_name()
    looked = look_at_roots(roots, lambda root: _held_at(root, namespace, wanted, host), wait,
                           "kvtier-writers-look")
    found = [held for root in roots if isinstance(got := looked.get(root), list) for held in got]
    return found, all(root in looked for root in roots)


def _held_at(root: str, namespace: Namespace, wanted: Callable[[str, LeaseInfo], bool],
             host: str) -> list[tuple[str, LeaseInfo, bool]]:
    """``_held_here`` on one path."""
    found: list[tuple[str, LeaseInfo, bool]] = []
    try:
        with SafeDir.open(root) as top, top.subdir(namespace.id) as ns_dir, \
                ns_dir.subdir(WRITERS_DIR) as writers:
            for name in default_writer_ids(host):
                try:
                    with writers.subdir(name) as segment:
                        lease = read_lease(segment)
                        if lease is not None and lease.host == host and wanted(name, lease):
                            locked = locked_here(segment)
                            if locked is not False:
                                found.append((name, lease, locked is True))
                except OSError:
                    continue
    except OSError:
        pass
    return found
