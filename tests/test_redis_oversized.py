"""What another client of a Valkey/Redis store puts there far larger than anything kvtier
writes is never read whole, against real redis-servers (one, and a three-node cluster): a
value of 64 MiB under a chunk's key is that chunk damaged, read no further than a bound,
and the store stays in service. (The case of one server, read straight into host slots, is
also tests/test_remote_losses.py's.)"""

import tracemalloc

import numpy as np
import pytest

from kvtier.io.result import IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.redis_tier import RedisTier
from kvtier.remote.values import value_key
from tests.helpers.redis_server import RedisCluster, RedisServer, needs_redis

pytestmark = needs_redis
RAW = 1 << 16
NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
HUGE = 64 << 20
READ_AT_MOST = 24 << 20  # the bound (8 MiB past a chunk) and what the reading itself holds
LOADED = 10.0  # round trips on a loaded machine


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, RAW, dtype=np.uint8)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nodes = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield nodes
    nodes.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    one = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield one
    one.stop()


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
        cluster_client(cluster).set(value_key("kvtier:", NS.digest(), keys[0]), b"\0" * HUGE)
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
