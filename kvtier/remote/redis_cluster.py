"""A round trip to a Redis cluster: each key's commands to its slot's node, every node's
written by hand on one connection of that node (``redis_direct``'s requests: a value read
off the socket into its chunk's buffer, with the same bounds as on one server), all nodes
written before any is read, the replies read in the order they arrive, and never a command
re-sent but on a pooled connection found dead (``pooled``) and to follow a redirect.

redis-py's ``ClusterPipeline.execute`` re-sends every command of a node that timed out one
at a time, each waiting the socket timeout again: a hung node would cost a batch
(its keys + 1) x ``remote_timeout``; and it reads each value whole into memory. Here a node
that fails (its connection refused or reset, or no reply before the deadline) costs its own
keys (each answered by that failure: a miss) and goes out of service (``node_outages``):
the other nodes' replies are kept, and the next round trips answer its keys at once
without asking it, until ``retry_s`` has passed. Replies are read as they begin to arrive,
so a hung node is read last and the deadline it runs out holds no other node's reply. A
node reached only once the deadline had passed (another node took it) fails its keys but
is not taken out. The round trip fails as a whole (raises) only when no node answered it
and every primary of the slot map is out of service: the cluster unreachable.

A key the cluster redirects is asked for again once, within the same round trip and its
deadline, at the node the reply names, as every cluster client does: after ``MOVED`` (its
slot moved) as it is, after ``ASK`` (its slot migrating, the key moved already or never
there) after an ``ASKING``; the keys of one node and kind in one request, all written
before any is read. Asked again, a key keeps what that node answered; a node the client
does not know or one out of service leave the key answered as its redirect's error (a
miss), a node that fails answers its failure, a second redirect is not followed. ``MOVED``,
``TRYAGAIN`` and a node that failed flag the slot map as stale, for the caller to ask for
it anew; ``ASK`` does not (the map names the node that sent it, the slot only migrating).
"""

from __future__ import annotations

import selectors
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvtier.remote.deadline import bounded, expired, time_left
from kvtier.remote.node_outages import NodeOutages
from kvtier.remote.pooled import PooledExchange, Request
from kvtier.remote.redis_client import as_builtin
from kvtier.remote.resp import Target

Requests = list[tuple[Any, Request[list[Any]], list[int]]]  # (node, request, indexes)
# (node, exchange, indexes, whether its node's turn came with its share of the time left)
Sent = tuple[Any, PooledExchange[list[Any]], list[int], bool]


class ClusterReplies(list[Any]):
    """Per-command replies in order (a refused command, or one whose node failed or is out
    of service, as its exception); ``stale``: the client's slot map is out of date (a
    redirect, a node that failed); ``answered``: the nodes that answered, by name, and when;
    ``failed``: the nodes that failed (name, failure, whether theirs: not a deadline
    another node's reply had run out)."""

    stale = False

    def __init__(self, size: int) -> None:
        super().__init__([None] * size)
        self.answered: list[tuple[str, float]] = []  # (node, when its reply was read)
        self.heard = False  # some node answered, in the whole round trip
        self.failed: list[tuple[str, BaseException, bool]] = []


def cluster_exchange(client: Any, names: Sequence[bytes],
                     make: Callable[[list[int]], Request[list[Any]]],
                     outages: NodeOutages, replies: ClusterReplies,
                     health: bool = True) -> ClusterReplies:
    """What ``make(indexes)`` asks (a request about ``names[i]`` for each index, one reply
    each) sent through ``client`` (a ``RedisCluster``) to the node of each name's slot, one
    request per node (none to a node out of service; a node on trial after one, last),
    then the keys redirected to the nodes named; the replies in the order of ``names``, in
    ``replies`` (made for as many). Raises the first failure when the cluster is
    unreachable, as the module says (a slot no node serves too): what ``replies`` holds
    then is what was read before it. Without ``health`` (hints) no node is taken out."""
    by_node: dict[str, tuple[Any, list[int]]] = {}
    admitted: dict[str, Any] = {}  # node name -> its keys' answer without asking it, or None
    for i, name in enumerate(names):
        node = client.get_node_from_key(name)
        if node.name not in admitted:  # once a node: a trial claimed is this round trip's
            admitted[node.name] = outages.admit(node.name)
        replies[i] = admitted[node.name]
        if replies[i] is None:
            by_node.setdefault(node.name, (node, []))[1].append(i)
    trial = {name for name in by_node if outages.on_trial(name)}
    requests = sorted(((node, make(at), at) for node, at in by_node.values()),
                      key=lambda request: request[0].name in trial)
    redirected = _exchange(client, requests, replies)
    failed = {name: exc for name, exc, own in replies.failed if own}
    unreachable = bool(failed) and not replies.answered and all(
        node.name in failed or outages.out(node.name) for node in client.get_primaries())
    _settle(replies, outages, health, quiet=unreachable)
    if unreachable:  # the tier goes out of service, and says so
        raise next(iter(failed.values()))
    if redirected and not expired():
        _follow(client, redirected, make, replies, outages, health)
    return replies


def _settle(replies: ClusterReplies, outages: NodeOutages, health: bool, quiet: bool = False) -> None:
    """Each node that answered back in service; with ``health`` each that failed (its own
    failure) out: ``quiet``, logged at debug only (the whole tier going out says it)."""
    for name, at in replies.answered:
        outages.answered(name, at)
    for name, exc, own in replies.failed:
        if own and health:
            outages.failed(name, exc, quiet)
    replies.answered, replies.failed = [], []


def _exchange(client: Any, requests: Requests, replies: ClusterReplies) -> dict[Target, list[int]]:
    """Each request to its node, all written before any is read, the replies read as they
    arrive and put in ``replies`` at their indexes, a node's failure there instead (noted
    in ``replies.failed``); the indexes of the keys redirected, by where to. Every
    connection not read to its end is dropped."""
    taken: list[tuple[Any, Any]] = []  # (pool, connection)
    try:
        return _read_all(_send_all(client, requests, replies, taken), replies)
    except BaseException:
        for _, connection in taken:
            connection.disconnect()  # maybe out of step with its replies
        raise
    finally:
        for pool, connection in taken:
            pool.release(connection)


def _send_all(client: Any, requests: Requests, replies: ClusterReplies,
              taken: list[tuple[Any, Any]]) -> list[Sent]:
    """Each request sent to its node on a connection of its pool (added to ``taken``); the
    exchanges sent. A node that fails to take one or to be written fails its keys, as its
    own failure. A connection made now gets its share of the time left (that over the
    nodes still to write and their reads): a hung node's connect (accepted by its kernel,
    never answered) holds no other's. A node whose turn comes once the deadline has passed
    (a hung node's send took it) fails its keys, not its own failure, and no connection
    of its pool is taken: its pooled ones stay in step, kept for the next round trip.
    Each exchange sent says whether its node's turn came with at least its share of the
    round trip's time left (that over every node and the reads): a node whose turn came
    late (a slow node's large write before it) and that then times out, connecting or
    reading, is not blamed."""
    sent: list[Sent] = []
    budget = time_left()
    for at, (node, request, indexes) in enumerate(requests):
        if expired():
            _node_failed(node, indexes, TimeoutError(
                "not sent: another node of the cluster took the round trip's time"), replies, False)
            continue
        left = time_left()
        fair = budget is None or left is None or left >= budget / (len(requests) + 1)
        pool = client.get_redis_connection(node).connection_pool
        try:
            with bounded(None if left is None else left / (len(requests) - at + 1)):
                taken.append((pool, pool.get_connection()))  # (made now where none is pooled)
        except Exception as exc:  # a connect cut short by the nodes before: not its own
            _node_failed(node, indexes, exc, replies, fair or not isinstance(as_builtin(exc), TimeoutError))
            continue
        exchange = PooledExchange(taken[-1][1], request)
        try:
            exchange.send()
        except Exception as exc:
            taken[-1][1].disconnect()  # out of step
            _node_failed(node, indexes, exc, replies)
            continue
        sent.append((node, exchange, indexes, fair))
    return sent


def _read_all(sent: list[Sent], replies: ClusterReplies) -> dict[Target, list[int]]:
    """The replies of the exchanges ``sent``, read as they arrive, put in ``replies``; the
    indexes of the keys redirected, by where to."""
    redirected: dict[Target, list[int]] = {}
    for (node, exchange, indexes, fair), silent in _by_arrival(sent):
        began = silent or not expired()  # else another node's reply took the time left
        try:
            got = exchange.read()
        except Exception as exc:
            exchange.connection.disconnect()  # out of step
            own = began and (fair or not isinstance(as_builtin(exc), TimeoutError))
            _node_failed(node, indexes, exc, replies, own)
            for i, reply in zip(indexes, exchange.request.done, strict=False):
                replies[i] = reply  # those read before the failure, whole and checked
            continue
        replies.answered.append((node.name, time.monotonic()))
        replies.heard = True
        for i, reply in zip(indexes, got, strict=True):
            replies[i] = reply
        replies.stale |= exchange.request.stale
        for at, target in exchange.request.targets.items():
            redirected.setdefault(target, []).append(indexes[at])
    return redirected


def _by_arrival(sent: list[Sent]) -> Iterator[tuple[Sent, bool]]:
    """``sent`` in the order their replies begin to arrive, while the deadline leaves time to
    wait for one; those none came for by then after, in their order, said ``silent`` (the
    second of each pair). Without a deadline, or with one node, as they are."""
    if len(sent) < 2 or time_left() is None:
        yield from ((item, False) for item in sent)
        return
    with selectors.DefaultSelector() as selector:
        for item in sent:
            sock = item[1].connection._sock
            if sock is None or getattr(sock, "pending", lambda: 0)():  # (TLS: bytes decrypted)
                yield item, False
                continue
            selector.register(sock.fileno(), selectors.EVENT_READ, item)
        while selector.get_map():
            ready = selector.select(time_left())
            if not ready:
                break
            for key, _ in ready:
                selector.unregister(key.fileobj)
                yield key.data, False
        rest = [key.data for key in selector.get_map().values()]
    yield from ((item, True) for item in rest)


def _node_failed(node: Any, indexes: list[int], exc: BaseException, replies: ClusterReplies,
                 own: bool = True) -> None:
    """``node``'s keys answered by its failure ``exc`` (``own``: not a deadline another
    node's reply ran out), noted in ``replies.failed``, the slot map stale."""
    for i in indexes:
        replies[i] = exc
    replies.failed.append((node.name, exc, own))
    replies.stale = True  # it may have failed over: its slots served by another node now


def _follow(client: Any, redirected: dict[Target, list[int]],
            make: Callable[[list[int]], Request[list[Any]]], replies: ClusterReplies,
            outages: NodeOutages, health: bool) -> None:
    """The keys ``redirected`` asked for again at the nodes named, once; what those nodes
    answer replaces their replies (a node that fails answers its failure)."""
    requests: Requests = []
    for (asking, host, port), indexes in redirected.items():
        node = client.get_node(host=host, port=port)
        if node is None:  # a node the slot map does not know yet: asked for at the next
            replies.stale = True
            continue
        if outages.admit(node.name) is not None:
            continue
        request = make(indexes)
        request.asking = asking
        requests.append((node, request, indexes))
    _exchange(client, requests, replies)  # a second redirect is not followed
    _settle(replies, outages, health)
