"""The remote tier under load while its store fails: a redis-server killed and restarted
empty, hung (SIGSTOP) and resumed, and a cluster primary killed so that its replica takes
over. Stores keep serving through all of it: every call returns, every byte served is the
right one, and hits through the store resume once it is back."""

import os
import signal
import time

import numpy as np
import pytest
import torch

from kvtier import KVStore
from kvtier.tiers.base import TierName
from tests.helpers.faults import Load, check
from tests.helpers.kv import CHUNK, SMALL, make_kv, same_bytes
from tests.helpers.redis_server import RedisCluster, RedisServer, needs_redis

pytestmark = [needs_redis, pytest.mark.slow]
CHUNK_BYTES = SMALL.token_bytes * CHUNK


def store(url: str, **config) -> KVStore:
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 16 * CHUNK_BYTES, "remote_url": url,
           "remote_timeout": "300ms", "remote_retry": "200ms", "io_threads": 2, **config}
    return KVStore(SMALL, cfg, model="m")


def eventually_hits_remote(reader: KVStore, writer: KVStore, seed: int, timeout: float = 30.0) -> None:
    """A prompt only ``writer`` stores reaches ``reader`` through the store."""
    toks = np.random.default_rng(seed).integers(0, 30000, 2 * CHUNK).tolist()
    deadline = time.monotonic() + timeout
    while True:
        writer.put(toks, make_kv(toks))
        writer.flush(5)
        if reader.lookup(toks).chunks_by_tier.get(TierName.REMOTE) == 2:
            out = torch.zeros_like(make_kv(toks))
            assert reader.get(toks, out) == len(toks) and same_bytes(out, make_kv(toks))
            return
        assert time.monotonic() < deadline, "no hit through the store after it came back"
        time.sleep(0.2)


def test_a_server_killed_restarted_and_hung_under_load_costs_misses_only(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    a, b = store(server.url), store(server.url)
    try:
        with Load([a, b]) as load:
            time.sleep(1.5)
            server.stop()  # SIGKILL: every value is gone with it
            time.sleep(1.0)
            server.start()  # empty, on the same port
            time.sleep(1.0)
            os.kill(server.process.pid, signal.SIGSTOP)  # hung: answers nothing
            time.sleep(1.0)
            os.kill(server.process.pid, signal.SIGCONT)
            time.sleep(1.5)
        check(load)
        assert a.stats().remote_failures + b.stats().remote_failures > 0
        eventually_hits_remote(b, a, seed=99)
    finally:
        os.kill(server.process.pid, signal.SIGCONT) if server.process.poll() is None else None
        assert a.close(timeout=10) and b.close(timeout=10)
        server.stop()


def test_a_cluster_primary_failing_over_to_its_replica_under_load(tmp_path):
    cluster = RedisCluster(tmp_path / "cluster", replicas=1).start()
    url = cluster.url.replace(str(cluster.nodes[0].port), str(cluster.nodes[1].port))
    a, b = store(url, remote_timeout="1s"), store(url, remote_timeout="1s")
    try:
        victim = next(n for n in cluster.primaries() if n is not cluster.nodes[1])
        with Load([a, b]) as load:
            time.sleep(1.5)
            victim.stop()
            deadline = time.monotonic() + 60
            while len(cluster.primaries()) < 3:  # its replica promoted
                assert time.monotonic() < deadline, "no replica took over"
                time.sleep(0.2)
            time.sleep(1.5)
        check(load)
        eventually_hits_remote(b, a, seed=98, timeout=60)
    finally:
        assert a.close(timeout=10) and b.close(timeout=10)
        cluster.stop()
