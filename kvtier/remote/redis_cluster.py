"""A round trip to a Redis cluster: each command to its slot's node, every node's commands
pipelined, all nodes written before any is read, and never a command re-sent.

redis-py's ``ClusterPipeline.execute`` re-sends every command of a node that timed out one
at a time, each waiting the socket timeout again: a hung node would cost a batch
(its keys + 1) x ``remote_timeout``. Here a node that does not answer fails the round trip
once (its connection error or timeout raised), and a command the cluster redirects
(``MOVED``, ``ASK``, ``TRYAGAIN``: a slot moved or moving) is answered as its error and
flags the slot map as stale, for the caller to make the client anew.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ClusterReplies(list[Any]):
    """Per-command replies in order (a refused command as its exception); ``stale``: the
    cluster redirected some command, so the client's slot map is out of date."""

    stale = False


def cluster_round_trip(client: Any, commands: Sequence[tuple[str, tuple]]) -> ClusterReplies:
    """``commands`` (name, args) sent through ``client`` (a ``RedisCluster``) in one
    exchange per node; raises the first connection error or timeout of any node."""
    from redis.cluster import PipelineCommand
    from redis.exceptions import AskError, MovedError, TryAgainError
    from redis.exceptions import ConnectionError as LostConnection
    from redis.exceptions import TimeoutError as TimedOut

    stack = [PipelineCommand((name.upper(), *args), {}, i) for i, (name, args) in enumerate(commands)]
    pipe = client.pipeline(transaction=False)
    replies = ClusterReplies(pipe.send_cluster_commands(stack, raise_on_error=False,
                                                        allow_redirections=False))
    for reply in replies:
        if isinstance(reply, LostConnection | TimedOut):
            raise reply
        if isinstance(reply, MovedError | AskError | TryAgainError):
            replies.stale = True
    return replies
