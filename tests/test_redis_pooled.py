"""The Valkey/Redis tier's pooled connections that died while idle, against a real
redis-server behind a load balancer that forgets flows without a word
(``tests/helpers/balancer.py``): the store restarted, or its clients killed, and the
tier's next request on each pooled connection is reset before any byte of a reply. Such a
request is sent again once on a fresh connection, within the round trip's deadline: no
round trip fails and the tier stays in service, on one server and on a cluster's node. A
fresh connection that fails too, a connection that never served, and a store that does not
answer are not asked again. Without a balancer, a close reaches the idle connection and
costs nothing either."""

import os
import signal
import threading

import numpy as np
import pytest

from kvtier.io.result import IOStatus
from kvtier.remote.redis_tier import RedisTier
from tests.helpers.balancer import Balancer
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.redis_setup import NS, RAW, chunk, key, running, wait_cluster

pytestmark = needs_redis
ANSWERED = {IOStatus.OK, IOStatus.MISSING}


@pytest.fixture
def behind(tmp_path):
    with running(RedisServer(tmp_path / "redis")) as server, Balancer(server.port) as balancer:
        yield server, balancer
        if server.process is not None and server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)


def break_flows(server: RedisServer, how: str, balancer: Balancer | None = None) -> None:
    """The store's connections closed (``how``: a restart or ``CLIENT KILL``); behind a
    balancer, once every flow through it has lost its server side."""
    if how == "restart":
        server.stop()
        server.start()
    else:
        server.client().execute_command("CLIENT", "KILL", "TYPE", "normal")
    if balancer is not None:
        balancer.wait_dead()


def calls(tier: RedisTier) -> dict:
    """Each kind of round trip, answering whether the store answered it."""
    into = np.zeros(RAW, np.uint8)
    return {
        "get": lambda: tier.get_many([key(1)], [into])[0].status in ANSWERED,
        "parts": lambda: tier.get_parts([key(1)], [into], [(1,)])[0].status in ANSWERED,
        "put": lambda: tier.put_many([(key(1), chunk(1))])[0].ok,
        "exists": lambda: tier.exists_answered([key(1)]) is not None,
        "remove": lambda: tier.remove([key(2)]),
        "append": lambda: tier.append_records([(key(1), b"record")]),
        "read": lambda: tier.read_records(b"0", 16) is not None,
    }


@pytest.mark.parametrize("how", ["restart", "kill"])
def test_a_request_on_a_pooled_connection_that_died_idle_is_sent_again_fresh(behind, how):
    """(every pooled connection failed one round trip, each taking the tier out of service
    for ``remote_retry``, after a restart behind a balancer or an idle timeout)"""
    server, balancer = behind
    tier = RedisTier(balancer.url, NS, RAW, timeout_s=5.0, retry_s=60.0,
                     parts=(RAW // 2, RAW // 2))
    try:
        for name, call in calls(tier).items():
            assert tier.put_many([(key(1), chunk(1))])[0].ok  # the pool holds a served one
            resets = balancer.resets
            break_flows(server, how, balancer)
            assert call(), name
            assert balancer.resets > resets, name  # the pooled connection was dead
            assert tier.failures == 0 and not tier.down, name
        into = np.zeros(RAW, np.uint8)
        assert tier.put_many([(key(3), chunk(3))])[0].ok
        assert tier.get_many([key(3)], [into])[0].ok and np.array_equal(into, chunk(3))
    finally:
        tier.close()


@pytest.mark.parametrize("how", ["restart", "kill"])
def test_a_close_the_client_was_told_of_costs_nothing_either(tmp_path, how):
    """Without a balancer in between the store's close reaches the idle connection, and
    redis-py's pool makes it anew before handing it out: nothing to send again."""
    server = RedisServer(tmp_path / "redis").start()
    tier = RedisTier(server.url, NS, RAW, timeout_s=5.0, retry_s=60.0)
    try:
        for name, call in calls(tier).items():
            assert tier.put_many([(key(1), chunk(1))])[0].ok
            break_flows(server, how)
            assert call(), name
            assert tier.failures == 0 and not tier.down, name
    finally:
        tier.close()
        server.stop()


def cluster_behind(workdir) -> tuple[RedisServer, Balancer]:
    """A one-node cluster that names the balancer as its address: every connection of a
    cluster client goes through it."""
    server = RedisServer(workdir, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
    balancer = Balancer(server.port)
    server.extra += ("--cluster-announce-ip", "127.0.0.1", "--cluster-announce-port", str(balancer.port))
    server.start()
    client = server.client()
    client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    wait_cluster(server)
    return server, balancer


@pytest.mark.parametrize("how", ["restart", "kill"])
def test_a_cluster_nodes_pooled_connection_that_died_idle_is_sent_again_fresh(tmp_path, how):
    server, balancer = cluster_behind(tmp_path / "node")
    tier = RedisTier(f"redis+cluster://127.0.0.1:{balancer.port}", NS, RAW, timeout_s=5.0,
                     retry_s=60.0, parts=(RAW // 2, RAW // 2))
    try:
        for name, call in calls(tier).items():
            assert tier.put_many([(key(1), chunk(1))])[0].ok
            resets = balancer.resets
            break_flows(server, how, balancer)
            if how == "restart":
                wait_cluster(server)
            assert call(), name
            assert balancer.resets > resets, name
            assert tier.failures == 0 and not tier.down, name
    finally:
        tier.close()
        balancer.stop()
        server.stop()


def test_every_pooled_connection_dead_at_once_fails_no_round_trip(behind):
    server, balancer = behind
    tier = RedisTier(balancer.url, NS, RAW, timeout_s=5.0, retry_s=60.0)
    try:
        def hammer(answers: list, start: threading.Barrier) -> None:
            start.wait()
            for i in range(6):
                answers.append(tier.put_many([(key(i), chunk(i))])[0].ok)
                answers.append(tier.exists_answered([key(i)]) == [True])

        for _ in range(2):  # connections made in parallel, then all of them dead
            answers: list = []
            start = threading.Barrier(4)
            threads = [threading.Thread(target=hammer, args=(answers, start)) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert answers == [True] * 48
            break_flows(server, "restart", balancer)
        assert balancer.resets > 0 and tier.failures == 0
    finally:
        tier.close()


def test_a_fresh_connection_that_fails_too_ends_the_round_trip(behind):
    """A store gone for good costs one failed round trip, as before, and one connection
    more; a connection that fails on its first round trip is not tried again."""
    server, balancer = behind
    tier = RedisTier(balancer.url, NS, RAW, timeout_s=5.0, retry_s=0.0)
    try:
        assert tier.exists_answered([key(1)]) == [False]
        server.stop()
        balancer.wait_dead()
        opened = balancer.connections
        assert tier.get_many([key(1)], [np.zeros(RAW, np.uint8)])[0].status is IOStatus.IO_ERROR
        assert tier.failures == 1 and balancer.connections == opened + 1
        assert tier.exists_answered([key(1)]) is None  # on that fresh one: no retry
        assert tier.failures == 2 and balancer.connections == opened + 2
    finally:
        tier.close()


def test_a_store_that_does_not_answer_is_not_asked_again(behind):
    """A timeout says the store is slow, not that the connection was dead: the round trip
    fails once, on its one connection."""
    server, balancer = behind
    tier = RedisTier(balancer.url, NS, RAW, timeout_s=0.5, retry_s=0.0)
    try:
        assert tier.exists_answered([key(1)]) == [False]
        opened = balancer.connections
        os.kill(server.process.pid, signal.SIGSTOP)
        assert tier.get_many([key(1)], [np.zeros(RAW, np.uint8)])[0].status is IOStatus.TIMED_OUT
        assert tier.failures == 1 and balancer.connections == opened
    finally:
        tier.close()
