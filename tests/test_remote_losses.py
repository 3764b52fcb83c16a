"""What a remote store loses or refuses is never taken as stored: a store restarted empty
(or evicting) gets its chunks written again, and ``flush()`` is false while a chunk it was
asked to write is not there (a full store refusing writes)."""

import numpy as np
import pytest
import torch

from kvtier import KVStore
from kvtier.remote.values import value_key
from kvtier.tiers.base import TierName
from tests.helpers.kv import CHUNK, SMALL, make_kv, same_bytes
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.store import remote_store

pytestmark = needs_redis
REMOTE = TierName.REMOTE
CHUNK_BYTES = SMALL.token_bytes * CHUNK


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()




def tokens(seed: int, chunks: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 30000, chunks * CHUNK).tolist()


def remote_keys(server) -> list[bytes]:
    return sorted(server.client().scan_iter(match="kvtier:*"))


def served_whole(s: KVStore, toks) -> bool:
    out = torch.zeros_like(make_kv(toks))
    return s.get(toks, out) == len(toks) and same_bytes(out, make_kv(toks))


def test_a_flush_writes_again_what_a_restarted_store_lost(server):
    toks = tokens(1, 32)
    with remote_store(server.url) as a, remote_store(server.url) as b:
        assert a.put(toks, make_kv(toks)) == len(toks) and a.flush(10)
        assert len(remote_keys(server)) == 32
        server.stop()
        server.start()  # empty, on the same port
        a.put(toks, make_kv(toks))  # the same prefix again: held here already
        result = a.flush(10)
        assert len(remote_keys(server)) == 32
        assert result and result.remote_not_written == 0
        assert b.lookup(toks).chunks_by_tier == {REMOTE: 32}
        assert served_whole(b, toks)


def test_with_min_hits_a_flush_writes_again_the_chunks_that_earned_them_and_were_lost(server):
    """Hot chunks served from host memory are never asked about by a get: the flush asks,
    whatever ``remote_min_hits``, and writes again those the store lost; chunks that never
    earned their hits stay unwritten."""
    toks, cold = tokens(2, 4), tokens(3, 2)
    with remote_store(server.url, remote_min_hits=1) as a:
        a.put(toks, make_kv(toks))
        assert served_whole(a, toks)  # its first load: written
        a.put(cold, make_kv(cold))  # never loaded: not written
        assert a.flush(10) and len(remote_keys(server)) == 4
        server.stop()
        server.start()  # empty, on the same port
        assert served_whole(a, toks)  # hot here: nothing asks the store
        result = a.flush(10)
        assert result and result.remote_not_written == 0
        assert len(remote_keys(server)) == 4


def test_a_chunk_a_lookup_finds_gone_is_written_at_its_next_put(server):
    first, second, third = tokens(2, 8), tokens(3, 8), tokens(4, 8)
    with remote_store(server.url, host_capacity=16 * CHUNK_BYTES) as a:
        for toks in (first, second, third):  # first: out of host memory at the end
            assert a.put(toks, make_kv(toks)) == len(toks) and a.flush(10)
        assert a.lookup(first).chunks_by_tier == {REMOTE: 8}
        for key in a.keys(first):  # the store evicts them
            server.client().delete(value_key("kvtier:", a.namespace.digest(), key))
        assert a.lookup(first).tokens == 0  # "not there": forgotten
        assert a.put(first, make_kv(first)) == len(first)
        assert a._state.remote.drain(10)  # white-box: the background writes are over
        assert len(remote_keys(server)) == 24


@pytest.mark.parametrize("maxmemory", ["2mb", "1mb"])
def test_flush_is_false_while_a_full_store_refuses_writes(tmp_path, maxmemory):
    srv = RedisServer(tmp_path / "full", "--maxmemory", maxmemory,
                      "--maxmemory-policy", "noeviction").start()
    try:
        with remote_store(srv.url, chunk_tokens=256, host_capacity="64MiB") as s:
            toks = np.arange(256 * 24).tolist()
            assert s.put(toks, make_kv(toks)) == len(toks)
            result = s.flush(10)
            stored = len(remote_keys(srv))
            assert stored < 24 and s.stats().remote_failures > 0
            assert not result and not result.timed_out
            assert result.remote_not_written == 24 - stored
            assert not s.flush(10)  # still held and not written: said again
            assert served_whole(s, toks)  # the store serves on from host memory
    finally:
        srv.stop()


def test_a_value_far_longer_than_a_chunk_is_damaged_and_the_store_stays_in_service(server):
    """A value of 64 MiB put under a chunk's key by another client: that chunk is damaged,
    the chunks read after it on the dropped connection are not read, and the store is not
    taken out of service for it (it was, at every read of that key)."""
    from kvtier.io.result import IOStatus
    from kvtier.keys import ChunkKey, Namespace
    from kvtier.remote.redis_tier import RedisTier

    ns = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
    raw = 1 << 16
    tier = RedisTier(server.url, ns, raw, timeout_s=5.0, retry_s=60.0)
    keys = [ChunkKey(i.to_bytes(16, "big")) for i in range(3)]
    good = np.arange(raw, dtype=np.uint8)
    assert all(r.ok for r in tier.put_many([(keys[0], good), (keys[2], good)]))
    server.client().set(value_key("kvtier:", ns.digest(), keys[1]), b"\0" * (64 << 20))
    into = [np.zeros(raw, np.uint8) for _ in keys]
    got = [r.status for r in tier.get_many(keys, into)]
    assert got == [IOStatus.OK, IOStatus.CORRUPT, IOStatus.IO_ERROR], got
    assert not tier.down and tier.failures == 0
    assert [r.status for r in tier.get_many([keys[2]], into[2:])] == [IOStatus.OK]
    assert np.array_equal(into[2], good)
    tier.close()


def test_a_log_read_that_fails_takes_the_store_out_of_service_for_no_lookup(server, monkeypatch):
    """The log of token records names chunks for KV events: hints. An entry another client
    made too large to read within ``remote_timeout`` failed its read, and took the store out
    of service for lookups and loads too, again at every read of the log."""
    from kvtier.keys import ChunkKey, Namespace
    from kvtier.remote.redis_tier import RedisTier

    ns = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
    tier = RedisTier(server.url, ns, 1 << 16, timeout_s=5.0, retry_s=60.0)
    key = ChunkKey(bytes(16))
    assert all(r.ok for r in tier.put_many([(key, np.zeros(1 << 16, np.uint8))]))
    real = tier._round_trip

    def log_too_large(client, names, make, *rest):
        if names[0].startswith(b"kvtier:log:"):
            raise TimeoutError("Timeout reading from socket")
        return real(client, names, make, *rest)

    monkeypatch.setattr(tier, "_round_trip", log_too_large)
    assert tier.read_records(b"0", 16) is None
    assert not tier.down and tier.failures == 0 and tier.exists([key]) == [True]
    tier.close()


def test_pooled_connections_keep_their_flows_alive_when_idle(server):
    """(a load balancer or NAT that forgets an idle flow without a word cost the next round
    trip its whole timeout, then an outage of ``remote_retry``, after every lull; redis-py
    8 turns keepalive on by itself, the 5.x kvtier allows does not)"""
    import socket

    from kvtier.keys import ChunkKey, Namespace
    from kvtier.remote.redis_tier import RedisTier

    ns = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
    tier = RedisTier(server.url, ns, 1 << 16, timeout_s=5.0, retry_s=60.0)
    assert tier.exists([ChunkKey(bytes(16))]) == [False]
    pool = tier._client.connection_pool
    connection = pool.get_connection()
    try:
        sock = connection._sock
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
    finally:
        pool.release(connection)
        tier.close()
