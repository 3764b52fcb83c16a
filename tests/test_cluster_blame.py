"""Which node of a Redis cluster a failed round trip blames (takes out of service): one
whose request went out with its share of the round trip's time and that then gave no reply
is blamed; one sent its request late, because a slow node's send before it took most of
the time, is not blamed for a timeout (its keys are misses this once), though a reset or a
refusal still counts as its own. White-box: the round trip's steps with stand-in nodes."""

import socket
import time
from types import SimpleNamespace

from kvtier.remote.deadline import bounded, time_left
from kvtier.remote.redis_cluster import ClusterReplies, _read_all, _send_all


class Request:
    """A request whose send may dawdle (until the round trip has ``until_left`` seconds
    left) and whose read fails with ``fails``."""

    def __init__(self, fails: BaseException, until_left: float | None = None) -> None:
        self.fails, self.until_left = fails, until_left
        self.done, self.stale, self.replica, self.asking, self.targets = [], False, False, False, {}

    def send(self, connection) -> None:
        while self.until_left is not None and (time_left() or 0.0) > self.until_left:
            time.sleep(0.01)

    def read(self, connection):
        raise self.fails


def stand_in(name: str):
    """A node, and a client whose pool for it hands out a connection on a socket pair."""
    mine, _ = socket.socketpair()
    connection = SimpleNamespace(_sock=mine, disconnect=lambda: None)
    pool = SimpleNamespace(get_connection=lambda: connection, release=lambda c: None)
    return SimpleNamespace(name=name), pool


def blamed(requests: list[tuple[str, Request]], budget: float) -> dict[str, bool]:
    """Each node's failure in one round trip of ``requests`` within ``budget`` seconds:
    whether it was its own."""
    nodes = {name: stand_in(name) for name, _ in requests}
    client = SimpleNamespace(get_redis_connection=lambda node: SimpleNamespace(
        connection_pool=nodes[node.name][1]))
    replies = ClusterReplies(len(requests))
    with bounded(budget):
        sent = _send_all(client, [(nodes[name][0], request, [i])
                                  for i, (name, request) in enumerate(requests)], replies, [])
        _read_all(sent, replies)
    return {name: own for name, _, own in replies.failed}


def test_a_node_sent_its_request_with_its_share_of_the_time_is_blamed_for_no_reply():
    assert blamed([("a", Request(TimeoutError("no reply")))], 0.5) == {"a": True}


def test_a_node_sent_its_request_late_is_not_blamed_for_no_reply_but_for_a_reset():
    slow = Request(TimeoutError("no reply"), until_left=0.9)  # its send takes 2 s of 3
    late = blamed([("slow", slow), ("late", Request(TimeoutError("no reply")))], 3.0)
    assert late == {"slow": True, "late": False}
    reset = Request(TimeoutError("no reply"), until_left=0.9)
    assert blamed([("slow", reset), ("late", Request(ConnectionResetError()))], 3.0) == \
        {"slow": True, "late": True}
