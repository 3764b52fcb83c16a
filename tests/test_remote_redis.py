"""The Valkey/Redis remote tier against a real redis-server on loopback: batched round
trips, every value verified (a damaged, truncated, foreign or evicted value is a miss, never
wrong bytes), and a store that is down, slow or full answers results, never exceptions."""

import os
import signal
import time

import numpy as np
import pytest

from kvtier.io.result import IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.redis_tier import PASSWORD_ENV, RedisTier, check_url
from kvtier.remote.values import VALUE_HEADER_BYTES, value_key
from tests.helpers.redis_server import RedisServer, needs_redis

pytestmark = needs_redis
RAW = 64 * 1024
NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, RAW, dtype=np.uint8)


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def tier(server, namespace=NS, **options) -> RedisTier:
    return RedisTier(server.url, namespace, RAW, **{"timeout_s": 1.0, "retry_s": 0.3, **options})


def get(t: RedisTier, keys):
    dsts = [np.zeros(RAW, np.uint8) for _ in keys]
    return t.get_many(keys, dsts), dsts


def test_a_batch_put_is_read_back_byte_for_byte_and_exists_in_one_trip(server):
    t = tier(server)
    assert all(r.ok for r in t.put_many([(key(i), chunk(i)) for i in range(8)]))
    assert t.exists([key(i) for i in range(10)]) == [True] * 8 + [False] * 2
    results, dsts = get(t, [key(i) for i in range(10)])
    assert [r.status for r in results] == [IOStatus.OK] * 8 + [IOStatus.MISSING] * 2
    assert all(np.array_equal(dsts[i], chunk(i)) for i in range(8))
    t.close()


def test_namespaces_share_one_store_without_seeing_each_other(server):
    other = Namespace(model="other", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
    a, b = tier(server), tier(server, other)
    a.put_many([(key(1), chunk(1))])
    assert b.exists([key(1)]) == [False]
    assert get(b, [key(1)])[0][0].status is IOStatus.MISSING


@pytest.mark.parametrize("damage", ["flip payload", "flip header", "truncate", "other chunk",
                                    "not kvtier's"])
def test_a_damaged_value_is_a_miss_never_wrong_bytes(server, damage):
    t = tier(server)
    t.put_many([(key(1), chunk(1)), (key(2), chunk(2))])
    raw = server.client()
    name = value_key("kvtier:", NS.digest(), key(1))
    value = bytearray(raw.get(name))
    if damage == "flip payload":
        value[VALUE_HEADER_BYTES + 1000] ^= 0xFF
    elif damage == "flip header":
        value[40] ^= 0x01
    elif damage == "truncate":
        value = value[: len(value) // 2]
    elif damage == "other chunk":
        value = bytearray(raw.get(value_key("kvtier:", NS.digest(), key(2))))
    else:
        value = bytearray(b"hello")
    raw.set(name, bytes(value))
    (result,), _ = get(t, [key(1)])
    assert result.status is IOStatus.CORRUPT, result
    (good,), (dst,) = get(t, [key(2)])
    assert good.ok and np.array_equal(dst, chunk(2))


def test_values_the_store_evicted_are_misses(tmp_path):
    srv = RedisServer(tmp_path / "redis", "--maxmemory", "4mb",
                      "--maxmemory-policy", "allkeys-lru").start()
    try:
        t = tier(srv)
        for i in range(200):  # 13 MB of values into 4 MB
            t.put_many([(key(i), chunk(i))])
        results, dsts = get(t, [key(i) for i in range(200)])
        hits = [i for i, r in enumerate(results) if r.ok]
        assert 0 < len(hits) < 200
        assert {r.status for r in results} <= {IOStatus.OK, IOStatus.MISSING}
        assert all(np.array_equal(dsts[i], chunk(i)) for i in hits)
    finally:
        srv.stop()


def test_a_full_store_refuses_puts_as_no_space(tmp_path):
    srv = RedisServer(tmp_path / "redis", "--maxmemory", "2mb",
                      "--maxmemory-policy", "noeviction").start()
    try:
        t = tier(srv)
        statuses = [r.status for i in range(64) for r in t.put_many([(key(i), chunk(i))])]
        assert IOStatus.NO_SPACE in statuses and not t.down  # the store is up, only full
    finally:
        srv.stop()


def test_a_store_down_is_failures_then_a_retry_once_it_is_back(server):
    t = tier(server)
    t.put_many([(key(1), chunk(1))])
    server.stop()
    started = time.monotonic()
    (result,), _ = get(t, [key(1)])
    assert result.status in (IOStatus.IO_ERROR, IOStatus.TIMED_OUT) and t.down
    assert get(t, [key(1)])[0][0].status is IOStatus.PATH_DOWN  # no trip while out of service
    assert t.put_many([(key(2), chunk(2))])[0].status is IOStatus.PATH_DOWN
    assert t.exists([key(1)]) == [False]
    assert time.monotonic() - started < 5
    server.start()  # restarted empty, on the same port
    time.sleep(0.35)
    assert not t.down
    assert get(t, [key(1)])[0][0].status is IOStatus.MISSING
    assert t.put_many([(key(1), chunk(1))])[0].ok and get(t, [key(1)])[0][0].ok
    assert t.failures == 1


def test_a_hung_store_times_out_within_the_timeout(server):
    t = tier(server, timeout_s=0.3)
    t.put_many([(key(1), chunk(1))])
    os.kill(server.process.pid, signal.SIGSTOP)  # hung: connections open, no replies
    try:
        started = time.monotonic()
        (result,), _ = get(t, [key(1)])
        assert result.status is IOStatus.TIMED_OUT and time.monotonic() - started < 1.5
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    time.sleep(0.35)
    results, (dst,) = get(t, [key(1)])
    assert results[0].ok and np.array_equal(dst, chunk(1))  # back after retry_s


def test_credentials_come_from_the_environment_only(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=PASSWORD_ENV):
        check_url("redis://user:secret@127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="scheme"):
        check_url("http://127.0.0.1:6379")
    srv = RedisServer(tmp_path / "redis", "--requirepass", "s3cret").start()
    try:
        denied = tier(srv)
        assert denied.put_many([(key(1), chunk(1))])[0].status is IOStatus.IO_ERROR
        allowed = RedisTier(srv.url, NS, RAW, environ={PASSWORD_ENV: "s3cret"})
        assert allowed.put_many([(key(1), chunk(1))])[0].ok
        assert "s3cret" not in allowed.describe()
    finally:
        srv.stop()
    assert os.environ.get(PASSWORD_ENV) is None


def test_a_buffer_the_tier_cannot_read_into_fails_that_call_only(server):
    parted = tier(server, parts=(RAW // 2, RAW // 2))
    assert parted.put_many([(key(1), chunk(1))])[0].ok
    strided = np.zeros(2 * RAW, np.uint8)[::2]  # e.g. a column of a 2-D buffer
    read_only = np.zeros(RAW, np.uint8)
    read_only.flags.writeable = False
    for dst in (strided, read_only, np.zeros(RAW // 2, np.uint8)):
        (whole,) = parted.get_many([key(1)], [dst])
        (part,) = parted.get_parts([key(1)], [dst], [(1,)])
        assert whole.status is IOStatus.IO_ERROR and part.status is IOStatus.IO_ERROR
        assert "contiguous" in whole.detail and not dst.any()
    assert parted.failures == 0 and not parted.down  # the store is fine: the tier stays up
    results, (dst,) = get(parted, [key(1)])
    assert results[0].ok and np.array_equal(dst, chunk(1))


def test_a_put_to_a_store_that_died_is_a_failure_and_a_hung_one_times_out(server):
    big = np.zeros(64 * 2**20, np.uint8)  # more than the socket buffers take
    patient = RedisTier(server.url, NS, big.nbytes, timeout_s=10, retry_s=0.3)  # a busy machine
    assert patient.put_many([(key(1), big)])[0].ok
    assert patient.put_many([(key(1), chunk(1))])[0].status is IOStatus.IO_ERROR  # not a chunk's size
    t = RedisTier(server.url, NS, big.nbytes, timeout_s=0.3, retry_s=0.3)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        assert t.put_many([(key(2), big)])[0].status is IOStatus.TIMED_OUT
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    server.stop()
    time.sleep(0.35)
    assert t.put_many([(key(3), big)])[0].status is IOStatus.IO_ERROR


def test_a_cluster_spreads_the_chunks_over_its_nodes(tmp_path):
    from tests.helpers.redis_server import RedisCluster

    cluster = RedisCluster(tmp_path / "cluster").start()
    try:
        t = RedisTier(cluster.url, NS, RAW, timeout_s=10.0, retry_s=0.3)
        put = t.put_many([(key(i), chunk(i)) for i in range(24)])
        assert all(r.ok for r in put), [r for r in put if not r.ok][:3]
        assert t.exists([key(i) for i in range(26)]) == [True] * 24 + [False] * 2
        results, dsts = get(t, [key(i) for i in range(24)])
        assert all(r.ok for r in results) and all(np.array_equal(dsts[i], chunk(i)) for i in range(24))
        held = [n.client().dbsize() for n in cluster.nodes]
        assert sum(held) == 24 and all(h > 0 for h in held)
        t.close()
    finally:
        cluster.stop()
