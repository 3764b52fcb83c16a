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

    def __init__(self, fails: BaseException, until_left: float | None = None,
                 connect_fails: BaseException | None = None) -> None:
        self.fails, self.until_left, self.connect_fails = fails, until_left, connect_fails
        self.done, self.stale, self.replica, self.asking, self.targets = [], False, False, False, {}

    def send(self, connection) -> None:
        while self.until_left is not None and (time_left() or 0.0) > self.until_left:
            time.sleep(0.01)

    def read(self, connection):
        raise self.fails


def stand_in(name: str, connect_fails: BaseException | None = None):
    """A node, and a client whose pool for it hands out a connection on a socket pair (or
    fails to make one with ``connect_fails``)."""
    mine, _ = socket.socketpair()
    connection = SimpleNamespace(_sock=mine, disconnect=lambda: None)

    def get_connection():
        if connect_fails is not None:
            raise connect_fails
        return connection
    pool = SimpleNamespace(get_connection=get_connection, release=lambda c: None)
    return SimpleNamespace(name=name), pool


def blamed(requests: list[tuple[str, Request]], budget: float) -> dict[str, bool]:
    """Each node's failure in one round trip of ``requests`` within ``budget`` seconds:
    whether it was its own."""
    nodes = {name: stand_in(name, request.connect_fails) for name, request in requests}
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


def test_a_node_whose_connect_was_cut_short_by_a_slow_node_before_it_is_not_blamed():
    """Its connect got only what the slow node's send left (a connect is given its share
    of the time left): a timeout then is not its own; a refusal is."""
    slow = Request(TimeoutError("no reply"), until_left=0.5)  # its send takes 2.5 s of 3
    cut = Request(TimeoutError("no reply"), connect_fails=TimeoutError("connect timed out"))
    refused = Request(TimeoutError("no reply"), connect_fails=ConnectionRefusedError())
    late = blamed([("slow", slow), ("cut", cut), ("refused", refused)], 3.0)
    assert late == {"slow": True, "cut": False, "refused": True}
    alone = Request(TimeoutError("no reply"), connect_fails=TimeoutError("connect timed out"))
    assert blamed([("alone", alone)], 0.5) == {"alone": True}  # its whole share: its own
