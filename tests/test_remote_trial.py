"""A single Redis server that hangs (SIGSTOP: its port takes connections, nothing answers):
once ``retry_s`` is over, one round trip asks it again (its trial) and waits out its bound;
every other call meanwhile finds the tier out of service and answers at once, instead of
each waiting out its own bound on a store still hung. A trial that works brings the tier
back for all."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from kvtier.io.result import IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.redis_tier import RedisTier
from tests.helpers.redis_server import RedisServer, needs_redis

pytestmark = needs_redis
RAW = 4096
NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
KEYS = [ChunkKey(i.to_bytes(16, "big")) for i in range(4)]


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def gets_at_once(tier: RedisTier, count: int) -> list[IOStatus]:
    """``count`` gets of every key started together: the first status of each."""
    start, statuses = threading.Barrier(count), []

    def get() -> None:
        start.wait()
        statuses.append(tier.get_many(KEYS, [np.zeros(RAW, np.uint8) for _ in KEYS])[0].status)

    threads = [threading.Thread(target=get) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return statuses


def test_once_retry_s_is_over_one_round_trip_tries_a_hung_store_the_others_answer_at_once(server):
    tier = RedisTier(server.url, NS, RAW, timeout_s=0.5, retry_s=1.0)
    assert all(r.ok for r in tier.put_many([(k, np.full(RAW, 7, np.uint8)) for k in KEYS]))
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        assert tier.get_many(KEYS[:1], [np.zeros(RAW, np.uint8)])[0].status is IOStatus.TIMED_OUT
        assert tier.down and tier.failures == 1
        time.sleep(1.1)  # past retry_s: the next round trip is the trial
        statuses = gets_at_once(tier, 6)
        assert sorted(s.name for s in statuses) == ["PATH_DOWN"] * 5 + ["TIMED_OUT"]
        assert tier.failures == 2 and tier.down  # failed once more, not six times
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    time.sleep(1.1)  # the store answers again: the next trial brings the tier back
    got = tier.get_many(KEYS, [np.zeros(RAW, np.uint8) for _ in KEYS])
    assert all(r.ok for r in got) and not tier.down
    assert gets_at_once(tier, 4) == [IOStatus.OK] * 4  # in service for all
    tier.close()


def test_a_trial_that_never_ends_lapses_and_another_round_trip_tries(server):
    """A trial's claim lapses after ``trial_s`` (a round trip that neither failed nor
    answered: it cannot happen with a bounded round trip, and must not hold the tier out);
    writes are never turned away by another's trial."""
    tier = RedisTier(server.url, NS, RAW, timeout_s=0.5, retry_s=0.2)
    assert tier.put_many([(KEYS[0], np.full(RAW, 7, np.uint8))])[0].ok
    tier._failed("get", TimeoutError("a round trip failed"))  # out of service
    time.sleep(0.3)
    claimed = threading.Thread(target=tier._admit)  # a thread that claims the trial and ends
    claimed.start()
    claimed.join()
    assert tier.down  # for every other thread, until the claim lapses
    assert tier.get_many(KEYS[:1], [np.zeros(RAW, np.uint8)])[0].status is IOStatus.PATH_DOWN
    # a write goes on beside another's trial (held back, it would be lost)
    assert tier.put_many([(KEYS[1], np.full(RAW, 8, np.uint8))])[0].ok
    time.sleep(tier.trial_s + 0.1)
    assert tier.get_many(KEYS[:1], [np.zeros(RAW, np.uint8)])[0].ok and not tier.down
    tier.close()


class _Node:
    name = "10.0.0.1:7000"


class _Cluster:
    """A cluster client whose every key is on one node."""

    def get_node_from_key(self, name):
        return _Node()

    def get_primaries(self):
        return [_Node()]


def test_a_round_trip_that_asked_no_node_lets_its_trial_go(monkeypatch):
    """Every key of the trial on a cluster node out of service alone: the round trip asks
    nothing (no news of the store), and its claim is let go rather than hold the tier out
    for every other thread."""
    tier = RedisTier("redis+cluster://127.0.0.1:1", NS, RAW, timeout_s=1.0, retry_s=0.1)
    monkeypatch.setattr(tier, "_connected", lambda what: _Cluster())
    monkeypatch.setattr(tier.slot_map, "start", lambda client: None)
    tier._failed("get", ConnectionError("the whole cluster unreachable"))
    tier.outages.failed(_Node.name, TimeoutError("the node failed"), quiet=True)
    time.sleep(0.15)  # past the tier's retry_s, not the node's own outage
    tier.outages._until[_Node.name] = (time.monotonic() + 5, False, False, time.monotonic())
    trial = threading.Thread(target=lambda: tier._trip("exists", [b"k"], lambda at: None))
    trial.start()
    trial.join()
    assert not tier.down  # to every other thread: the next round trip is a trial again
    tier.close()


def test_the_tier_reads_out_of_service_until_a_round_trip_works_not_until_retry_s_is_over(server):
    """``down`` lets a trial go once ``retry_s`` is over; the health the gauges show
    (``out_of_service``, ``health``) stays out until a round trip works (a store still dead
    read in service between two retries: a review)."""
    tier = RedisTier(server.url, NS, RAW, timeout_s=0.5, retry_s=0.2)
    assert tier.put_many([(KEYS[0], np.full(RAW, 7, np.uint8))])[0].ok
    tier._failed("get", TimeoutError("a round trip failed"))  # out of service
    assert tier.down and tier.out_of_service and tier.health() == (True, 0)
    time.sleep(0.3)  # past retry_s, no round trip since
    assert not tier.down and tier.out_of_service and tier.health() == (True, 0)
    assert tier.get_many(KEYS[:1], [np.zeros(RAW, np.uint8)])[0].ok
    assert not tier.out_of_service and tier.health() == (False, 0)
    tier.close()


def test_a_round_trip_that_answers_after_anothers_failure_does_not_bring_the_tier_back(
        server, monkeypatch):
    """A round trip under way when another fails, and answering after it (a proxy, or a
    failover, serving some connections and not others), is no news that the store is back:
    the tier stays out until a round trip begun since works (a review)."""
    tier = RedisTier(server.url, NS, RAW, timeout_s=0.5, retry_s=0.2)
    assert tier.put_many([(KEYS[0], np.full(RAW, 7, np.uint8))])[0].ok
    real = tier._round_trip

    def failed_meanwhile(*args, **kwargs):
        replies = real(*args, **kwargs)
        tier._failed("get", TimeoutError("another round trip failed"))
        return replies
    monkeypatch.setattr(tier, "_round_trip", failed_meanwhile)
    assert tier.get_many(KEYS[:1], [np.zeros(RAW, np.uint8)])[0].ok  # its own answer holds
    time.sleep(0.3)  # past retry_s
    assert tier.out_of_service  # not brought back by the late answer
    monkeypatch.undo()
    assert tier.get_many(KEYS[:1], [np.zeros(RAW, np.uint8)])[0].ok and not tier.out_of_service
    tier.close()
