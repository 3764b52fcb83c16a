"""A round trip to a Redis cluster: each key's commands to its slot's node, every node's
written by hand on one connection of that node (``redis_direct``'s requests: a value read
off the socket into its chunk's buffer, with the same bounds as on one server), all nodes
written before any is read, and never a command re-sent but on a pooled connection found
dead (``pooled``).

redis-py's ``ClusterPipeline.execute`` re-sends every command of a node that timed out one
at a time, each waiting the socket timeout again: a hung node would cost a batch
(its keys + 1) x ``remote_timeout``; and it reads each value whole into memory. Here a node
that does not answer fails the round trip once (its connection error or timeout raised),
and a command the cluster redirects (``MOVED``, ``ASK``, ``TRYAGAIN``: a slot moved or
moving) is answered as its error and flags the slot map as stale, for the caller to ask
for it anew.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvtier.remote.pooled import PooledExchange, Request


class ClusterReplies(list[Any]):
    """Per-command replies in order (a refused command as its exception); ``stale``: the
    cluster redirected some command, so the client's slot map is out of date."""

    stale = False


def cluster_exchange(client: Any, names: Sequence[bytes],
                     make: Callable[[list[int]], Request[list[Any]]]) -> ClusterReplies:
    """What ``make(indexes)`` asks (a request about ``names[i]`` for each index, one reply
    each) sent through ``client`` (a ``RedisCluster``) to the node of each name's slot, one
    request per node; the replies in the order of ``names``. Raises the first failure of
    any node (a slot no node serves too), every connection not read to its end dropped."""
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for i, name in enumerate(names):
        node = client.get_node_from_key(name)
        by_node.setdefault(node.name, (node, []))[1].append(i)
    taken: list[tuple[Any, Any]] = []  # (pool, connection)
    exchanges: list[tuple[PooledExchange[list[Any]], list[int]]] = []
    replies, read = ClusterReplies([None] * len(names)), 0
    try:
        for node, indexes in by_node.values():
            pool = client.get_redis_connection(node).connection_pool
            taken.append((pool, pool.get_connection()))
            exchanges.append((PooledExchange(taken[-1][1], make(indexes)), indexes))
            exchanges[-1][0].send()
        for exchange, indexes in exchanges:
            for i, reply in zip(indexes, exchange.read(), strict=True):
                replies[i] = reply
            replies.stale |= exchange.request.redirected
            read += 1
    except BaseException:
        for _, connection in taken[read:]:
            connection.disconnect()  # out of step with its replies
        raise
    finally:
        for pool, connection in taken:
            pool.release(connection)
    return replies
