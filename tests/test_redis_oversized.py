"""What another client of a Valkey/Redis store puts there far larger than anything kvtier
writes is never read whole, against real redis-servers (one, and a three-node cluster): a
value of 64 MiB under a chunk's key is that chunk damaged, and an entry of 64 MiB in the
log of token records is passed over, each read no further than a bound, and the store
stays in service. (A value on one server, read straight into host slots, is also
tests/test_remote_losses.py's.)"""

import logging
import time
import tracemalloc

import numpy as np
import pytest

from kvtier.io.result import IOStatus
from kvtier.remote.redis_tier import RedisTier
from tests.helpers.drip_proxy import DripProxy
from tests.helpers.redis_server import RedisCluster, RedisServer, needs_redis
from tests.helpers.redis_setup import LOG, NS, RAW, chunk, key, name, running

pytestmark = needs_redis
HUGE = 64 << 20
READ_AT_MOST = 24 << 20  # the bound (8 MiB past a chunk) and what the reading itself holds
LOADED = 10.0  # round trips on a loaded machine
TOO_LARGE = (b"", b"")  # an entry passed over reads as one that names nothing


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running(RedisCluster(tmp_path_factory.mktemp("cluster"))) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running(RedisServer(tmp_path_factory.mktemp("redis"))) as one:
        yield one


def cluster_client(cluster: RedisCluster):
    import redis

    return redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port, socket_timeout=30)


def peak_bytes(call):
    """What ``call()`` answers, and the most memory Python held meanwhile beyond what it
    held before (the client's reply objects included)."""
    tracemalloc.start()
    try:
        answer = call()
        return answer, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_huge_value_under_a_chunks_key_on_a_cluster_is_not_read_whole(cluster):
    """(redis-py's cluster pipeline read it whole into memory: 64 MiB here, hundreds of MiB
    from a hostile writer, and past ``remote_timeout`` on a slower link at every read of
    it, taking the store out of service)"""
    tier = RedisTier(cluster.url, NS, RAW, timeout_s=LOADED, retry_s=60.0)
    try:
        keys = [key(i) for i in range(24)]
        assert all(r.ok for r in tier.put_many([(k, chunk(i)) for i, k in enumerate(keys)]))
        cluster_client(cluster).set(name(keys[0]), b"\0" * HUGE)
        into = [np.zeros(RAW, np.uint8) for _ in keys]
        got, peak = peak_bytes(lambda: tier.get_many(keys, into))
        assert got[0].status is IOStatus.CORRUPT and peak < READ_AT_MOST, (got[0], peak)
        assert all(r.status in (IOStatus.OK, IOStatus.IO_ERROR) for r in got[1:])
        assert not tier.down and tier.failures == 0
        read = [i for i, r in enumerate(got) if r.ok]
        assert len(read) >= 8  # the other nodes' chunks were read
        assert all(np.array_equal(into[i], chunk(i)) for i in read)
        again = tier.get_many(keys[1:], into[1:])  # on the connections left, or fresh ones
        assert all(r.ok for r in again) and all(np.array_equal(into[i], chunk(i)) for i in range(1, 24))
    finally:
        tier.close()


def log_with_a_huge_entry(tier: RedisTier, client) -> bytes:
    """Entries one and three are kvtier's, the second another client's of 64 MiB (with
    both fields); the huge entry's id."""
    assert tier.append_records([(key(1), b"one")])
    huge = client.xadd(LOG, {"k": bytes(key(2)), "r": b"\0" * HUGE})
    assert tier.append_records([(key(3), b"three")])
    return huge


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_a_huge_entry_in_the_log_of_token_records_is_passed_over_unread(where, server, cluster,
                                                                         caplog):
    """(the follower read it whole into memory at every read, and on a link too slow for
    it within ``remote_timeout`` never got past it until the stream's trimming removed it)"""
    url, client = (server.url, server.client()) if where == "server" else \
        (cluster.url, cluster_client(cluster))
    client.delete(LOG)
    tier = RedisTier(url, NS, RAW, timeout_s=LOADED, retry_s=60.0)
    try:
        huge = log_with_a_huge_entry(tier, client)
        caplog.set_level(logging.DEBUG, logger="kvtier")
        got, peak = peak_bytes(lambda: tier.read_records(b"0", 512))
        assert got == (huge, [(bytes(key(1)), b"one"), TOO_LARGE]) and peak < READ_AT_MOST, peak
        last, entries = tier.read_records(huge, 512)  # on from the entry after it
        assert entries == [(bytes(key(3)), b"three")] and tier.read_records(last, 512) == (last, [])
        assert tier.read_records(b"0", 512) == got  # passed over again, not logged again
        assert tier.records_passed_over == 2 and not tier.down and tier.failures == 0
        said = [r for r in caplog.records if "passed over" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG], said
    finally:
        tier.close()


def test_a_huge_entry_behind_a_slow_link_does_not_hold_the_follower(server):
    """64 MiB at about 3 MB/s takes 20 s: read through, every read of the log ran past
    ``remote_timeout`` and the follower never got past the entry."""
    server.client().delete(LOG)
    writer = RedisTier(server.url, NS, RAW, timeout_s=LOADED)
    slow = DripProxy(server.port, piece=1 << 16, pause=0.02, lifetime=60)
    tier = RedisTier(slow.url, NS, RAW, timeout_s=5.0, retry_s=60.0)
    try:
        huge = log_with_a_huge_entry(writer, server.client())
        started = time.monotonic()
        assert tier.read_records(b"0", 512) == (huge, [(bytes(key(1)), b"one"), TOO_LARGE])
        assert time.monotonic() - started < 5.0  # within the deadline (20 s read through)
        assert tier.read_records(huge, 512)[1] == [(bytes(key(3)), b"three")]
    finally:
        tier.close()
        writer.close()
        slow.stop()
