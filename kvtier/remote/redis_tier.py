"""The Valkey/Redis backend of the remote tier: ``redis://host:port/db``, ``rediss://``
(TLS) and ``redis+cluster://host:port`` (a cluster: any node; keys go to their slots' nodes).

Credentials never come from the URL (``redis_url``; it is logged and shown redacted):
``KVTIER_REMOTE_USERNAME`` and ``KVTIER_REMOTE_PASSWORD`` in the environment. Every batch is
one pipeline (one exchange per node: ``redis_cluster``), bounded as a whole by
``timeout_s`` (``deadline``: connecting, sending and every reply together, however slowly
the store drips its answer), with no client-side retries or re-sends: a slow or dead store
is a failure now (the tier out of service) and a retry after ``retry_s``, never a stalled
step. On a cluster a slow or dead node costs its own keys (misses) and is out of service
alone (``node_outages``); the tier goes out when the whole cluster does. The slot map is
asked for anew off the round trips (``slot_map``). One exception to "no re-sends": a
request on a pooled connection that was dead before it reached the store, or that reaches
a replica now (``READONLY``: a failover behind a virtual IP), is sent again once on a fresh
connection, within the same deadline (``pooled``); every request here may be applied twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from kvtier.config.redact import redacted
from kvtier.config.redis_url import PASSWORD_ENV, SCHEMES, USER_ENV, check_url, parse_url
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.base import RECORD_LOG, RemoteTier, log
from kvtier.remote.deadline import bounded
from kvtier.remote.node_outages import NodeOutages
from kvtier.remote.pooled import Request, exchange
from kvtier.remote.range_reads import RangeRead
from kvtier.remote.record_log import ENTRY_MAX, LogEntries, LogRead
from kvtier.remote.redis_client import answered, check_client, connect, explained, failed_reply, known_nodes
from kvtier.remote.redis_cluster import ClusterReplies, cluster_exchange
from kvtier.remote.redis_direct import Commands, Gets, Ranges, Sets
from kvtier.remote.slot_map import SlotMapRefresh
from kvtier.remote.values import ValueFormat, value_key

__all__ = ["PASSWORD_ENV", "SCHEMES", "USER_ENV", "RedisTier", "check_url"]
T = TypeVar("T")


class RedisTier(RemoteTier):
    """``RemoteTier`` on Valkey/Redis (``redis`` client, ``hiredis`` parser when installed)."""

    def __init__(self, url: str, namespace: Namespace, raw_bytes: int, *, timeout_s: float = 2.0,
                 retry_s: float = 5.0, prefix: str = "kvtier:",
                 environ: Mapping[str, str] | None = None, parts: Sequence[int] = ()) -> None:
        super().__init__(raw_bytes, retry_s, parts)
        self.url, self._ns, self._prefix = check_url(url), namespace.digest(), prefix
        self._format = ValueFormat(self._ns, raw_bytes, parts)
        self._timeout_s, self._environ = timeout_s, os.environ if environ is None else environ
        self.trial_s = 2 * timeout_s  # a round trip (its connect too) ends well within it
        check_client(url)  # a missing client fails the start, not the first round trip
        self._client: Any = None  # connected on first use: a store down at start is a miss
        self._connecting = threading.Lock()
        self._cluster = parse_url(url).cluster
        self.outages = NodeOutages(retry_s, self.describe())  # a cluster's nodes out of service
        self.slot_map = SlotMapRefresh(timeout_s, self._remade)
        self._said_cluster = False  # a redis:// URL naming a cluster's node was said
        self._refused: set[str] = set()  # the kinds of command the store's ACL refused, said
        self.records_passed_over = 0  # entries of the log of token records too large to read

    def _connected(self, what: str) -> Any:
        """The client, made on first use (a cluster client asks a node for the slot map),
        or the ``IOResult`` of a failed setup. One setup at a time: the callers that waited
        on it find the tier out of service when it failed, and do not try again."""
        with self._connecting:
            if self._client is not None:
                return self._client
            if self.down:
                return self._out_of_service()
            try:
                self._client = connect(self.url, self._timeout_s, self._environ)
            except Exception as exc:  # down before the lock is released
                return self._failed(what, explained(exc))
            return self._client

    def describe(self) -> str:
        return redacted(self.url)

    def _key(self, key: ChunkKey) -> bytes:
        return value_key(self._prefix, self._ns, key)

    def _run(self, what: str, commands: list[tuple[str, tuple]],
             health: bool = True) -> list[Any] | IOResult:
        """One pipelined round trip of ``commands`` (name, args: the key first); per-command
        replies (exceptions in place), or the failure of the whole. A command the store's
        ACL refuses is said once per kind (a warning naming the permission): the tier stays
        in service, and its lookups, removals or records would stop without a word."""
        replies = self._trip(what, [args[0] for _, args in commands],
                             lambda at: Commands(pick(commands, at)), health)
        if not isinstance(replies, IOResult) and what not in self._refused:
            refused = [e for e in map(explained, (r for r in replies if isinstance(r, Exception)))
                       if isinstance(e, PermissionError)]
            if refused:
                self._refused.add(what)
                log.warning("kvtier: remote tier %s: %s refused: %s", self.describe(), what,
                            refused[0])
        return replies

    def _trip(self, what: str, names: Sequence[bytes], make: Callable[[list[int]], Request[list[Any]]],
              health: bool = True) -> list[Any] | IOResult:
        """What ``make(indexes)`` asks about ``names[i]``, in one round trip within one
        deadline (one request on one server, one per node on a cluster): a reply per name,
        or the failure of the whole (a store, or every node of a cluster, that does not
        answer fails it once); one that fails partway keeps the replies read before it,
        the others answered by the failure (the store out of service all the same; on a
        cluster, the node).
        Without ``health`` (the log of token records: hints) a failure takes no one out of
        service."""
        # out, or (a lookup or read: on a request's path) another round trip's trial under way
        if not self._admit(health and what in ("exists", "get")):
            return self._out_of_service()
        failures = self.failures  # a late answer after another's failure is no news of health
        with bounded(self._timeout_s):
            client = self._connected(what)
            if isinstance(client, IOResult):
                return client
            read: list[Callable[[BaseException], list[Any]]] = []
            try:
                replies, answered = self._round_trip(client, names, make, read, health)
            except Exception as exc:  # the client raises its own errors for every transport fault
                # (without health, hints: a failed read of the log costs that read only)
                failure = (self._broken(what, exc) if health
                           else IOResult(IOStatus.IO_ERROR, 0, f"{what}: {explained(exc)}"))
                kept = [exc if r is None else r for r in (read[0](exc) if read else [])]
                return kept if any(not isinstance(r, BaseException) for r in kept) else failure
        if answered:  # (every node of a cluster out: answered without asking any, no news)
            self._answered(failures)
        else:
            self._no_news()
        return replies

    def _round_trip(self, client: Any, names: Sequence[bytes],
                    make: Callable[[list[int]], Request[list[Any]]],
                    read: list[Callable[[BaseException], list[Any]]],
                    health: bool) -> tuple[list[Any], bool]:
        """The replies to ``make``'s requests, and whether the store answered (a cluster:
        some node). Adds to ``read`` what gives, after a failure (the argument), a reply per
        name: those read before it, the failure for the rest. Without ``health`` no cluster
        node is taken out of service."""
        if not self._cluster:  # one connection, sent again on a fresh one if it was dead
            request = make(list(range(len(names))))
            read.append(lambda exc: [*request.done, *[exc] * (len(names) - len(request.done))])
            replies = exchange(client.connection_pool, request)
            if request.targets:
                self._cluster_node()
            return replies, True
        self.slot_map.start(client)  # where a reply said the map is stale: off this thread
        answers = ClusterReplies(len(names))
        read.append(lambda _: list(answers))
        cluster_exchange(client, names, make, self.outages, answers, health)
        if answers.stale:
            self.slot_map.mark()
        return list(answers), answers.heard

    def nodes_out(self) -> list[str]:
        return self.outages.names()

    def _cluster_node(self) -> None:
        """A reply redirected a key (``MOVED``, ``ASK``): the URL names a node of a cluster
        as one server. Its keys in other nodes' slots are misses; said once (a warning)."""
        if self._said_cluster:
            return
        self._said_cluster = True
        log.warning("kvtier: remote tier %s: the store redirected a key (MOVED): it is a node of "
                    "a Redis cluster, and the keys of other nodes' slots are misses; name it "
                    "redis+cluster://host:port (rediss+cluster:// with TLS) in remote_url "
                    "(docs/remote.md)", self.describe())

    def _broken(self, what: str, exc: BaseException) -> IOResult:
        """A failed round trip. A cluster's slot map, which may name nodes that failed over,
        is asked for anew off the round trips (``slot_map``); the client is kept: made anew
        in a round trip, it would spend that round trip's deadline on a node still hung
        (the URL's, or the one redis-py asks first), and fail it for every node."""
        if self._cluster:
            self.slot_map.mark()
        return self._failed(what, explained(exc))

    def _remade(self, old: Any) -> bool:
        """``old`` replaced by a client made anew from every node it knew (``slot_map``);
        False when another thread replaced or dropped it first."""
        new = connect(self.url, self._timeout_s, self._environ, known_nodes(old))
        with self._connecting:
            if self._client is old:
                self._client = new
                return True
        new.close()
        return False

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        replies = self._run("exists", [("exists", (self._key(k),)) for k in keys])
        if isinstance(replies, IOResult):
            return [False] * len(keys)
        return [r == 1 for r in replies]

    def exists_answered(self, keys: Sequence[ChunkKey]) -> list[bool | None] | None:
        replies = self._run("exists", [("exists", (self._key(k),)) for k in keys])
        if isinstance(replies, IOResult):
            return None
        return [None if isinstance(r, Exception) else r == 1 for r in replies]

    def remove(self, keys: Sequence[ChunkKey]) -> bool:
        replies = self._run("remove", [("unlink", (self._key(k),)) for k in keys])
        return not isinstance(replies, IOResult) and not any(
            isinstance(r, Exception) for r in replies)

    keeps_records = True  # a stream per namespace: ``<prefix>log:<namespace digest>``

    def append_records(self, items: Sequence[tuple[ChunkKey, bytes]]) -> bool:
        log_key = f"{self._prefix}log:{self._ns.hex()}".encode()
        replies = self._run("log", [("xadd", (log_key, "MAXLEN", "~", RECORD_LOG, "*", "k",
                                              bytes(key), "r", record)) for key, record in items])
        return not isinstance(replies, IOResult) and not any(
            isinstance(r, Exception) for r in replies)

    def read_records(self, after: bytes, count: int) -> tuple[bytes, list[tuple[bytes, bytes]]] | None:
        """Read with bounds (``record_log``): an entry far larger than kvtier's is passed
        over, answered as ``TOO_LARGE`` (it names nothing), counted and logged."""
        log_key = f"{self._prefix}log:{self._ns.hex()}".encode()
        got = self._trip("log", [log_key], lambda _: LogRead(log_key, after, count), health=False)
        if isinstance(got, IOResult) or not isinstance(got[0], LogEntries):
            return None
        if got[0].passed is not None:
            self._passed_over(got[0].passed)
        return got[0].last, got[0].entries

    def _passed_over(self, entry: bytes) -> None:
        self.records_passed_over += 1
        log.log(logging.WARNING if self.records_passed_over == 1 else logging.DEBUG,
                "kvtier: remote tier %s: the log of token records holds an entry (%s) larger "
                "than %d bytes, which kvtier never writes (another client's): passed over "
                "unread", self.describe(), entry.decode(errors="replace"), ENTRY_MAX)

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[np.ndarray]) -> list[IOResult]:
        """GET of each chunk in one pipelined round trip, each value read off the socket
        straight into its destination (``redis_direct.Gets``), then checked."""
        unfit = self._unfit(dsts)
        if unfit is not None:
            return [unfit] * len(keys)
        names = [self._key(k) for k in keys]
        got = self._trip("get", names, lambda at: Gets(self._format, pick(names, at),
                                                       pick(keys, at), pick(dsts, at)))
        return [got] * len(keys) if isinstance(got, IOResult) else [answered(r) for r in got]

    def get_parts(self, keys: Sequence[ChunkKey], dsts: Sequence[np.ndarray],
                  wanted: Sequence[Collection[int]]) -> list[IOResult]:
        """GETRANGE of each chunk's header and of the runs of parts ``wanted``, all in one
        pipelined round trip, read off the socket into place; a chunk that needs every part
        is one GETRANGE of the whole value, every part checked."""
        unfit = self._unfit(dsts)
        if unfit is not None:
            return [unfit] * len(keys)
        if not any(self._format.reads_alone(parts) for parts in wanted):
            return self.get_many(keys, dsts)
        every = range(len(self.parts))
        plans = [RangeRead(self._format, key, dst, parts if self._format.reads_alone(parts) else every)
                 for key, dst, parts in zip(keys, dsts, wanted, strict=True)]
        names = [self._key(plan.key) for plan in plans]
        got = self._trip("get", names, lambda at: Ranges(pick(plans, at), pick(names, at)))
        return [got] * len(plans) if isinstance(got, IOResult) else [answered(r) for r in got]

    def put_many(self, items: Sequence[tuple[ChunkKey, np.ndarray]]) -> list[IOResult]:
        """SET of each chunk in one pipelined round trip, its bytes sent from the caller's
        buffer with no copy (``redis_direct.Sets``)."""
        wrong = [raw.nbytes for _, raw in items if raw.nbytes != self.raw_bytes]
        if wrong:
            return [IOResult(IOStatus.IO_ERROR, 0, f"a payload of {wrong[0]} bytes: this tier's "
                             f"chunks have {self.raw_bytes}")] * len(items)
        names = [self._key(k) for k, _ in items]
        replies = self._trip("set", names, lambda at: Sets(self._format, pick(names, at),
                                                           pick(items, at)))
        if isinstance(replies, IOResult):
            return [replies] * len(items)
        return [IOResult(IOStatus.OK, self.raw_bytes) if r is True else failed_reply("set", r)
                for r in replies]

    def close(self) -> None:
        super().close()
        with self._connecting:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # a broken connection: nothing more to do
                client.close()
        self.slot_map.close(self._timeout_s)


def pick(items: Sequence[T], at: Sequence[int]) -> list[T]:
    """The items at the indexes ``at``, in that order."""
    return [items[i] for i in at]
