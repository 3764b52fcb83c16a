"""The redis-py client a ``RedisTier`` talks through: one server or a cluster, built from
a parsed URL (``redis_url``), with a socket timeout, no client-side retries, credentials
from the environment only, and sockets that honour the calling thread's deadline
(``deadline.bounded``: one bound on a whole round trip, not on each receive); and what a
command's failed reply comes to as a chunk's result (``failed_reply``)."""

from __future__ import annotations

import inspect
import re
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.config.redis_url import PASSWORD_ENV, USER_ENV, parse_url
from kvtier.io.result import IOResult, IOStatus
from kvtier.remote.deadline import deadline_class
from kvtier.remote.node_outages import NodeOut

_NO_COMMAND = re.compile(r"no permissions to run the '([^']+)' command", re.IGNORECASE)
_NO_AUTH = re.compile(r"NOAUTH|authentication required|must be called with the client already "
                      r"authenticated|WRONGPASS|invalid (username-)?password", re.IGNORECASE)
SECURITY = "docs/remote.md, Security"


def client_module() -> Any:
    """The ``redis`` module; ``ImportError`` saying what to install."""
    try:
        import redis
    except ImportError:
        raise ImportError("the Redis remote tier needs the redis client: pip install "
                          "'kvtier[remote]' (or redis[hiredis])") from None
    return redis


# TCP keepalive on every connection: a probe after 30 s idle, then every 10 s, 3 unanswered
# drop it (a peer gone for good is noticed in about a minute, not at the next round trip)
KEEPALIVE = {socket.TCP_KEEPIDLE: 30, socket.TCP_KEEPINTVL: 10, socket.TCP_KEEPCNT: 3}


def connect(url: str, timeout_s: float, environ: Mapping[str, str],
            startup: Sequence[tuple[str, int]] = ()) -> Any:
    """A client of the store ``url`` names. One server's connects on first use; a cluster's
    asks the URL's node (then those of ``startup``) for the slot map now, and raises when
    none answers."""
    redis = client_module()
    from redis.backoff import NoBackoff
    from redis.connection import Connection, SSLConnection
    from redis.retry import Retry

    url_options = parse_url(url)
    options: dict[str, Any] = {
        "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
        # a pooled connection idle for minutes stays known to the load balancers and NAT on
        # the way (one that forgot it silently cost a round trip's timeout and an outage)
        "socket_keepalive": True, "socket_keepalive_options": KEEPALIVE,
        "username": environ.get(USER_ENV) or None, "password": environ.get(PASSWORD_ENV) or None,
        "retry": Retry(NoBackoff(), 0), "ssl": url_options.tls, **dict(url_options.client)}
    sockets = deadline_class(SSLConnection if url_options.tls else Connection)
    if url_options.cluster:
        return _cluster(url_options.host, url_options.port, startup, sockets, options)
    client = redis.Redis(host=url_options.host, port=url_options.port, db=url_options.db,
                         **options, **no_notifications(redis.Redis, options))
    client.connection_pool.connection_class = sockets  # Redis() picks its own for TLS
    return client


def _cluster(host: str, port: int, startup: Sequence[tuple[str, int]], sockets: type,
             options: dict[str, Any]) -> Any:
    """A cluster client whose every node's connections are ``sockets``. Made from a URL (a
    plain ``redis://`` one: TLS is ``sockets``' and the options' to say), since only then do
    redis-py's releases before 8.2 build each node's pool from the options, connection
    class and all (given host and port, they pass the options to ``Redis()``, which refuses
    a connection class)."""
    from redis.cluster import ClusterNode, RedisCluster

    named = f"[{host}]" if ":" in host else host
    nodes = [ClusterNode(h, p) for h, p in dict.fromkeys([(host, port), *startup])]
    options = {name: value for name, value in options.items() if name != "ssl"}
    return RedisCluster(url=f"redis://{named}:{port}", startup_nodes=nodes,  # the URL's first
                        connection_class=sockets, **options,
                        # its slot map is asked of the URL's (and ``startup``'s) names, never
                        # swapped for the addresses found: a cluster replaced whole, its name
                        # moved to new addresses, is found again there
                        dynamic_startup_nodes=False,
                        **no_notifications(RedisCluster, options))


def check_client(url: str) -> None:
    """Raise ``ImportError`` when the client is missing (``client_module``), and
    ``ValueError`` when ``url`` names a cluster with an option this redis-py drops for a
    cluster's nodes (before 7.4: ``ssl_ca_path``; before 7.0 ``ssl_check_hostname`` too):
    its nodes would connect without it."""
    redis = client_module()
    url_options = parse_url(url)
    if not url_options.cluster:
        return
    from redis.cluster import REDIS_ALLOWED_KEYS

    dropped = [name for name, _ in url_options.client if name not in REDIS_ALLOWED_KEYS]
    if dropped:
        raise ValueError(f"remote_url: {', '.join(dropped)}: redis-py {redis.__version__} "
                         "drops it for a cluster's nodes; install redis-py 7.4 or later "
                         "(pip install 'redis>=7.4'), or leave it out")


def no_notifications(client_class: type, options: Mapping[str, Any]) -> dict[str, Any]:
    """The option that keeps ``client_class``'s connections from turning on maintenance
    notifications, where it has them and ``options`` ask for RESP3 (redis-py 8 turns them on
    by itself on RESP3, and a store that sends them, Redis Software or Cloud, then pushes
    them among the replies ``resp`` reads by hand: every read failed as an unexpected
    reply). On RESP2 none is given: they are off, and some releases refuse the option
    there, even to turn them off."""
    if str(options.get("protocol", 2)) != "3":
        return {}
    if "maint_notifications_config" not in inspect.signature(client_class).parameters:
        return {}
    from redis.maint_notifications import MaintNotificationsConfig

    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


def known_nodes(client: Any) -> list[tuple[str, int]]:
    """The (host, port) of every node a cluster client knows."""
    return [(node.host, int(node.port)) for node in client.get_nodes()]


def as_builtin(exc: BaseException) -> BaseException:
    """The client's timeout, or the socket's, as the builtin ``TimeoutError`` (so it counts
    as timed out)."""
    if isinstance(exc, ImportError):  # the client is missing: nothing of it to import
        return exc
    from redis.exceptions import TimeoutError as RedisTimeout

    return TimeoutError(str(exc)) if isinstance(exc, RedisTimeout | TimeoutError) else exc


def explained(exc: BaseException) -> BaseException:
    """``exc`` as the tier reports it: a timeout as the builtin ``TimeoutError``; a refusal
    by the store's ACL naming the permission to grant, where the store says which."""
    text = str(exc)
    command = _NO_COMMAND.search(text)
    if command:
        return PermissionError(f"{text}: grant the ACL user {USER_ENV} names "
                               f"+{command.group(1)} ({SECURITY})")
    if "no permissions to access" in text.lower():
        return PermissionError(f"{text}: the ACL user's key pattern must cover remote_prefix, "
                               f"e.g. ~kvtier:* ({SECURITY})")
    if _NO_AUTH.search(text):  # no password given, or the wrong one
        return PermissionError(f"{text}: set {PASSWORD_ENV} (and {USER_ENV} for an ACL user) in "
                               f"the environment ({SECURITY})")
    if "Cluster mode is not enabled" in text:  # how redis-py reports CLUSTER SLOTS refused
        return ConnectionError(f"{text} (or the ACL user lacks +cluster|slots: {SECURITY})")
    return as_builtin(exc)


def answered(reply: IOResult | BaseException) -> IOResult:
    """A chunk's answer: its ``IOResult``, or the failure of its cluster node (a miss)."""
    return reply if isinstance(reply, IOResult) else failed_reply("get", reply)


def failed_reply(what: str, reply: Any) -> IOResult:
    """A command refused, or whose cluster node failed or is out of service
    (``PATH_DOWN``); a refused SET may say the store is full (``maxmemory`` with
    ``noeviction``: ``NO_SPACE``)."""
    from redis.exceptions import OutOfMemoryError

    exc = explained(reply)
    status = (IOStatus.PATH_DOWN if isinstance(reply, NodeOut) else IOStatus.NO_SPACE
              if isinstance(reply, OutOfMemoryError) else IOStatus.TIMED_OUT
              if isinstance(exc, TimeoutError) else IOStatus.IO_ERROR)
    return IOResult(status, 0, f"{what}: {exc}")
