"""A store that drips its answers (512 bytes every 0.2 s, each receive well inside the socket
timeout) holds no call past ``remote_timeout``: a round trip has one deadline over all its
sends and receives, missing it is a failure, and the tier goes out of service."""

import time

import numpy as np
import pytest
import torch

from kvtier import KVStore
from kvtier.io.result import IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.redis_tier import RedisTier
from tests.helpers.drip_proxy import DripProxy
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.redis_server import RedisServer, needs_redis

pytestmark = needs_redis
RAW = 64 * 1024  # 128 pieces of 512 bytes: about 26 s at the drip's pace
NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
BOUND = 4.0  # seconds: generous for a call bounded by remote_timeout=0.5


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


@pytest.fixture
def slow(server):
    proxy = DripProxy(server.port, lifetime=40)
    yield proxy
    proxy.stop()


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def test_a_dripping_store_times_a_get_out_within_its_timeout(server, slow):
    fast = RedisTier(server.url, NS, RAW)
    values = [np.full(RAW, i, np.uint8) for i in range(2)]
    assert all(r.ok for r in fast.put_many([(key(i), values[i]) for i in range(2)]))
    tier = RedisTier(slow.url, NS, RAW, timeout_s=0.5, retry_s=30)
    try:
        assert tier.exists([key(0), key(1)]) == [True, True]  # small answers: in time
        started = time.monotonic()
        got = tier.get_many([key(0), key(1)], [np.zeros(RAW, np.uint8) for _ in range(2)])
        assert time.monotonic() - started < BOUND
        assert [r.status for r in got] == [IOStatus.TIMED_OUT] * 2
        assert tier.failures == 1 and tier.down
        assert tier.get_many([key(0)], [np.zeros(RAW, np.uint8)])[0].status is IOStatus.PATH_DOWN
    finally:
        tier.close()
        fast.close()


def test_a_store_behind_a_dripping_link_costs_a_get_its_timeout_and_close_is_bounded(server, slow):
    toks = np.random.default_rng(3).integers(0, 30000, 16 * CHUNK).tolist()
    cfg = {"chunk_tokens": CHUNK, "host_capacity": "4MiB", "io_threads": 2,
           "remote_timeout": "500ms", "remote_retry": "30s"}
    with KVStore(SMALL, {**cfg, "remote_url": server.url}, model="m") as a:
        assert a.put(toks, make_kv(toks)) == len(toks) and a.flush(10)
    b = KVStore(SMALL, {**cfg, "remote_url": slow.url}, model="m")
    try:
        started = time.monotonic()
        assert b.get(toks, torch.zeros_like(make_kv(toks))) == 0  # 64 KiB of answers dripped
        assert time.monotonic() - started < BOUND
        stats = b.stats()
        assert stats.remote_failures > 0 and stats.remote_down
        assert b.get(toks, torch.zeros_like(make_kv(toks))) == 0
        assert b.stats().remote_lookups == stats.remote_lookups  # out of service: not asked
    finally:
        assert b.close(timeout=5)
