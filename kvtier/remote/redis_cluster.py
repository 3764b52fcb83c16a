"""A round trip to a Redis cluster: each key's commands to its slot's node, every node's
written by hand on one connection of that node (``redis_direct``'s requests: a value read
off the socket into its chunk's buffer, with the same bounds as on one server), all nodes
written before any is read, and never a command re-sent but on a pooled connection found
dead (``pooled``) and to follow a redirect.

redis-py's ``ClusterPipeline.execute`` re-sends every command of a node that timed out one
at a time, each waiting the socket timeout again: a hung node would cost a batch
(its keys + 1) x ``remote_timeout``; and it reads each value whole into memory. Here a node
that does not answer fails the round trip once (its connection error or timeout raised).

A key the cluster redirects is asked for again once, within the same round trip and its
deadline, at the node the reply names, as every cluster client does: after ``MOVED`` (its
slot moved) as it is, after ``ASK`` (its slot migrating, the key moved already or never
there) after an ``ASKING``; the keys of one node and kind in one request, all written
before any is read. Asked again, a key keeps what that node answered; a node the client
does not know, one that fails (the failure dropped its connection, the round trip going on)
or a second redirect leave the key answered as its redirect's error, a miss. ``MOVED`` and
``TRYAGAIN`` flag the slot map as stale, for the caller to ask for it anew; ``ASK`` does
not (the map names the node that sent it, the slot only migrating).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.remote.pooled import PooledExchange, Request
from kvtier.remote.resp import Target

log = logging.getLogger("kvtier")
Requests = list[tuple[Any, Request[list[Any]], list[int]]]  # (node, request, indexes)


class ClusterReplies(list[Any]):
    """Per-command replies in order (a refused command as its exception); ``stale``: the
    cluster redirected some command, so the client's slot map is out of date."""

    stale = False


def cluster_exchange(client: Any, names: Sequence[bytes],
                     make: Callable[[list[int]], Request[list[Any]]]) -> ClusterReplies:
    """What ``make(indexes)`` asks (a request about ``names[i]`` for each index, one reply
    each) sent through ``client`` (a ``RedisCluster``) to the node of each name's slot, one
    request per node, then the keys redirected to the nodes named; the replies in the
    order of ``names``. Raises the first failure of any node of the first requests (a slot
    no node serves too), every connection not read to its end dropped."""
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for i, name in enumerate(names):
        node = client.get_node_from_key(name)
        by_node.setdefault(node.name, (node, []))[1].append(i)
    replies = ClusterReplies([None] * len(names))
    redirected = _exchange(client, [(node, make(at), at) for node, at in by_node.values()],
                           replies)
    if redirected:
        _follow(client, redirected, make, replies)
    return replies


def _exchange(client: Any, requests: Requests, replies: ClusterReplies) -> dict[Target, list[int]]:
    """Each request to its node, all written before any is read, each reply put in
    ``replies`` at its index; the indexes of the keys redirected, by where to. Raises the
    first failure, every connection not read to its end dropped."""
    taken: list[tuple[Any, Any]] = []  # (pool, connection)
    exchanges: list[tuple[PooledExchange[list[Any]], list[int]]] = []
    redirected: dict[Target, list[int]] = {}
    read = 0
    try:
        for node, request, indexes in requests:
            pool = client.get_redis_connection(node).connection_pool
            taken.append((pool, pool.get_connection()))
            exchanges.append((PooledExchange(taken[-1][1], request), indexes))
            exchanges[-1][0].send()
        for exchange, indexes in exchanges:
            for i, reply in zip(indexes, exchange.read(), strict=True):
                replies[i] = reply
            replies.stale |= exchange.request.stale
            for at, target in exchange.request.targets.items():
                redirected.setdefault(target, []).append(indexes[at])
            read += 1
    except BaseException:
        for _, connection in taken[read:]:
            connection.disconnect()  # out of step with its replies
        raise
    finally:
        for pool, connection in taken:
            pool.release(connection)
    return redirected


def _follow(client: Any, redirected: dict[Target, list[int]],
            make: Callable[[list[int]], Request[list[Any]]], replies: ClusterReplies) -> None:
    """The keys ``redirected`` asked for again at the nodes named, once; what those nodes
    answer replaces their replies (a failure leaves them as they were)."""
    requests: Requests = []
    for (asking, host, port), indexes in redirected.items():
        node = client.get_node(host=host, port=port)
        if node is None:  # a node the slot map does not know yet: asked for at the next
            replies.stale = True
            continue
        request = make(indexes)
        request.asking = asking
        requests.append((node, request, indexes))
    try:
        _exchange(client, requests, replies)  # a second redirect is not followed
    except Exception as exc:  # those keys stay redirected: misses, no failure of the round trip
        log.debug("kvtier: a key the Redis cluster redirected could not be asked for again: %s",
                  exc)
