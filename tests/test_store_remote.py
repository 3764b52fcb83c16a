"""``KVStore`` with a remote tier (``remote_url``) on a real redis-server: two stores with
separate host memory and no shared directory ("two nodes") share chunks through it; every
value read is verified; the store down, hung, full or holding damaged values costs misses,
never wrong bytes or a failed call."""

import os
import signal
import time

import numpy as np
import pytest
import torch

from kvtier import KVStore
from kvtier.errors import ConfigError
from kvtier.io.result import IOResult, IOStatus
from kvtier.remote.values import value_key
from kvtier.tiers.base import TierName
from tests.helpers.fake_io import FakeEngine
from tests.helpers.kv import CHUNK, SMALL, make_kv, same_bytes
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.store import remote_store

pytestmark = needs_redis
REMOTE, HOST, DISK = TierName.REMOTE, TierName.HOST, TierName.DISK
CHUNK_BYTES = SMALL.token_bytes * CHUNK


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def store(server, **config) -> KVStore:
    return remote_store(server.url, **config)


def tokens(seed: int, chunks: int = 6) -> list[int]:
    return np.random.default_rng(seed).integers(0, 30000, chunks * CHUNK).tolist()


def read(s: KVStore, toks) -> tuple[int, torch.Tensor]:
    out = torch.zeros_like(make_kv(toks))
    return s.get(toks, out), out


def remote_keys(server) -> list[bytes]:
    return sorted(server.client().scan_iter(match="kvtier:*"))


def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_second_node_hits_what_the_first_stored_byte_for_byte(server):
    toks = tokens(1)
    with store(server) as a, store(server) as b:
        assert a.put(toks, make_kv(toks)) == len(toks)
        assert a.flush(10)
        assert len(remote_keys(server)) == 6
        hit = b.lookup(toks)
        assert hit.tokens == len(toks) and hit.chunks_by_tier == {REMOTE: 6}
        n, out = read(b, toks)
        assert n == len(toks) and same_bytes(out, make_kv(toks))
        stats = b.stats()
        assert stats.remote_reads == 6 and stats.remote_read_bytes == 6 * CHUNK_BYTES
        assert stats.chunks_loaded == {REMOTE: 6}
        # now in b's host memory: served from there, nothing asked of the store
        lookups = stats.remote_lookups
        assert b.lookup(toks).chunks_by_tier == {HOST: 6}
        n, out = read(b, toks)
        assert n == len(toks) and same_bytes(out, make_kv(toks))
        assert b.stats().remote_lookups == lookups and b.stats().remote_reads == 6
        assert b.stats().remote_writes == 0  # read from the store: not written back to it
        assert a.stats().remote_writes == 6


def test_a_prefix_runs_on_from_local_chunks_into_remote_ones(server):
    toks = tokens(2, 8)
    with store(server) as a, store(server) as b:
        a.put(toks, make_kv(toks))
        a.flush(10)
        b.put(toks[:3 * CHUNK], make_kv(toks[:3 * CHUNK]))
        assert b.lookup(toks).chunks_by_tier == {HOST: 3, REMOTE: 5}
        n, out = read(b, toks)
        assert n == len(toks) and same_bytes(out, make_kv(toks))


def test_chunks_read_from_the_store_are_written_to_the_local_disk(server, tmp_path):
    toks = tokens(3)
    (tmp_path / "b-disk").mkdir(mode=0o700)
    disk = {"disk_paths": [str(tmp_path / "b-disk")], "disk_capacity": 64 * CHUNK_BYTES}
    with store(server) as a:
        a.put(toks, make_kv(toks))
        a.flush(10)
    with store(server, **disk) as b:
        assert read(b, toks)[0] == len(toks)
        assert b.flush(10)
    server.stop()  # the store gone: b restarted serves them from its own disk
    with store(server, **disk) as b:
        assert b.lookup(toks).chunks_by_tier == {DISK: 6}
        n, out = read(b, toks)
        assert n == len(toks) and same_bytes(out, make_kv(toks))


def test_with_min_hits_a_chunk_is_written_once_it_was_loaded_that_often(server):
    toks = tokens(4, 2)
    with store(server, remote_min_hits=2) as a:
        a.put(toks, make_kv(toks))
        a.flush(10)
        assert remote_keys(server) == []
        read(a, toks)
        a.flush(10)
        assert remote_keys(server) == []
        read(a, toks)
        a.flush(10)
        assert len(remote_keys(server)) == 2 and a.stats().remote_writes == 2
        read(a, toks)
        a.flush(10)
        assert a.stats().remote_writes == 2  # known to be there: not written again


@pytest.mark.parametrize("damage", ["flip payload", "truncate", "other chunk"])
def test_a_damaged_value_ends_the_prefix_there_never_wrong_bytes(server, damage):
    toks = tokens(5)
    with store(server) as a, store(server) as b:
        a.put(toks, make_kv(toks))
        a.flush(10)
        raw = server.client()
        names = [value_key("kvtier:", b.namespace.digest(), k) for k in b.keys(toks)]
        value = bytearray(raw.get(names[3]))
        if damage == "flip payload":
            value[-100] ^= 0xFF
        elif damage == "truncate":
            value = value[:len(value) // 2]
        else:
            value = bytearray(raw.get(names[4]))
        raw.set(names[3], bytes(value))
        n, out = read(b, toks)
        assert n == 3 * CHUNK
        assert same_bytes(out[:, :, :n], make_kv(toks)[:, :, :n])
        assert b.stats().remote_failures == 1


@pytest.mark.parametrize("answer", [IOStatus.IO_ERROR, IOStatus.TIMED_OUT])
def test_a_read_that_fails_is_no_news_that_the_store_lost_the_chunk(server, monkeypatch, answer):
    """A read the store did not answer with the value (a timeout, a cluster's redirect)
    says nothing of what it holds: the chunk stays known there, and storing it again
    writes nothing. It was forgotten, and written again. Found by a review."""
    toks, other = tokens(7, chunks=2), tokens(8, chunks=2)
    with store(server, host_capacity=2 * CHUNK_BYTES) as a:
        for each in (toks, other):  # the second pushes the first out of host memory
            a.put(each, make_kv(each))
            assert a.flush(10)
        assert a.lookup(toks).chunks_by_tier == {TierName.REMOTE: 2}
        failed = IOResult(answer, 0, "get: MovedError: 1234 127.0.0.1:1")
        monkeypatch.setattr(a._state.remote.tier, "get_many", lambda keys, dsts: [failed] * len(keys))
        assert read(a, toks)[0] == 0 and a.stats().remote_failures >= 1
        a.put(toks, make_kv(toks))  # recomputed
        assert a.flush(10)
        assert a.stats().remote_writes == 4  # each chunk once


def test_a_key_of_another_type_under_a_chunks_name_is_written_over(server):
    """A list where a chunk's value goes (any key not a string: WRONGTYPE) is a value not
    kvtier's, as a damaged one is: a miss, and the chunk is written over it when stored
    again, though its writer knew it was there. Found by a review."""
    toks, other = tokens(9, chunks=2), tokens(10, chunks=2)
    with store(server, host_capacity=2 * CHUNK_BYTES) as a:
        for each in (toks, other):  # the second pushes the first out of host memory
            a.put(each, make_kv(each))
            assert a.flush(10)
        name = value_key("kvtier:", a.namespace.digest(), a.keys(toks)[0])
        raw = server.client()
        raw.delete(name)
        raw.rpush(name, b"not kvtier's")
        assert read(a, toks)[0] == 0 and a.stats().remote_failures == 1
        a.put(toks, make_kv(toks))  # recomputed
        assert a.flush(10)
        assert raw.type(name) == b"string"
    with store(server) as b:
        n, out = read(b, toks)
        assert n == len(toks) and same_bytes(out, make_kv(toks))


def test_a_chunk_evicted_between_lookup_and_read_is_a_miss(server):
    toks = tokens(6)
    with store(server) as a, store(server) as b:
        a.put(toks, make_kv(toks))
        a.flush(10)
        assert b.lookup(toks).tokens == len(toks)
        server.client().delete(value_key("kvtier:", b.namespace.digest(), b.keys(toks)[2]))
        n, out = read(b, toks)
        assert n == 2 * CHUNK and same_bytes(out[:, :, :n], make_kv(toks)[:, :, :n])


def test_the_store_down_costs_misses_and_it_is_used_again_once_back(server):
    toks, later = tokens(7), tokens(8)
    with store(server) as a, store(server) as b:
        a.put(toks, make_kv(toks))
        a.flush(10)
        server.stop()
        assert b.lookup(toks).tokens == 0  # a failed round trip: nothing there
        assert b.lookup(toks).tokens == 0  # out of service: not even asked
        assert read(b, toks)[0] == 0
        assert a.put(later, make_kv(later)) == len(later)  # stored locally all the same
        n, out = read(a, later)
        assert n == len(later) and same_bytes(out, make_kv(later))
        assert b.stats().remote_down
        server.start()  # an empty store on the same port
        time.sleep(0.4)  # remote_retry
        assert b.lookup(toks).tokens == 0
        assert not b.stats().remote_down
        fresh = tokens(9)
        a.put(fresh, make_kv(fresh))
        a.flush(10)
        wait_for(lambda: b.lookup(fresh).tokens == len(fresh), "a's new chunks never reached the store")
        n, out = read(b, fresh)
        assert n == len(fresh) and same_bytes(out, make_kv(fresh))


def test_a_hung_store_slows_no_call_past_its_timeout_and_close_is_bounded(server):
    toks = tokens(10)
    with store(server) as a:
        a.put(toks, make_kv(toks))
        a.flush(10)
    b = store(server, remote_timeout="200ms", remote_retry="30s")
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert b.lookup(toks).tokens == 0
        assert b.get(toks, torch.zeros_like(make_kv(toks))) == 0
        assert b.put(toks, make_kv(toks)) == len(toks)
        assert time.monotonic() - started < 5
        assert b.close(timeout=5)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def test_a_full_store_refuses_writes_and_the_store_serves_on(tmp_path):
    srv = RedisServer(tmp_path / "full", "--maxmemory", "2mb", "--maxmemory-policy", "noeviction").start()
    try:
        big = KVStore(SMALL, {"chunk_tokens": 256, "host_capacity": "64MiB", "remote_url": srv.url,
                              "io_threads": 2}, model="m")
        with big:
            toks = tokens(11, 1)[:0] + np.arange(256 * 24).tolist()
            assert big.put(toks, make_kv(toks)) == len(toks)
            big.flush(10)
            stats = big.stats()
            assert 0 < stats.remote_writes < 24 and stats.remote_failures > 0
            n, out = read(big, toks)
            assert n == len(toks) and same_bytes(out, make_kv(toks))
    finally:
        srv.stop()


def test_metrics_show_the_remote_tier_by_backend(server, monkeypatch):
    toks = tokens(12, 2)
    with store(server) as a:
        a.put(toks, make_kv(toks))
        a.flush(10)
        samples = {s.name: s for s in a.metric_samples()}
        written = samples["remote_chunks_total"].values
        assert written[(("backend", "redis"), ("direction", "write"))] == 2
        assert samples["remote_up"].values[(("backend", "redis"),)] == 1
        assert samples["remote_nodes_out"].values[(("backend", "redis"),)] == 0
        assert "remote_queue_depth" in samples
        # white-box: a cluster's tier with two nodes out of service alone
        monkeypatch.setattr(a._state.remote.tier, "nodes_out", lambda: ["10.0.0.1:6379", "10.0.0.2:6379"])
        assert a.stats().remote_nodes_out == 2
        samples = {s.name: s for s in a.metric_samples()}
        assert samples["remote_nodes_out"].values[(("backend", "redis"),)] == 2


def test_remote_config_is_checked_and_credentials_come_from_the_environment(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="credentials"):
        KVStore(SMALL, {"remote_url": "redis://user:secret@127.0.0.1:6379/0"}, model="m")
    with pytest.raises(ConfigError, match="scheme"):
        KVStore(SMALL, {"remote_url": "memcached://127.0.0.1:11211"}, model="m")
    with pytest.raises(ConfigError, match="host memory"):
        KVStore(SMALL, {"chunk_tokens": CHUNK, "host_capacity": 0, "gpu_capacity": "1MiB",
                        "remote_url": "redis://127.0.0.1:1/0"}, model="m", device="cpu")
    srv = RedisServer(tmp_path / "auth", "--requirepass", "s3cret").start()
    try:
        monkeypatch.setenv("KVTIER_REMOTE_PASSWORD", "s3cret")  # not taken for a config key
        toks = tokens(13, 2)
        with store(srv) as a:
            a.put(toks, make_kv(toks))
            a.flush(10)
            assert a.stats().remote_writes == 2
    finally:
        srv.stop()


def test_flush_writes_what_back_pressure_dropped(server):
    toks = tokens(14, 40)
    with store(server, host_capacity=64 * CHUNK_BYTES) as a:
        a._state.remote._max_pending = 2  # white-box: a queue of two, so that puts drop writes
        a.put(toks, make_kv(toks))
        assert a.stats().remote_dropped_writes > 0
        assert a.flush(20)
        assert a.stats().remote_writes == 40 and len(remote_keys(server)) == 40


def test_a_hung_store_never_holds_more_than_half_the_host_slots(server):
    first, second = tokens(15, 8), tokens(16, 4)
    s = store(server, host_capacity=8 * CHUNK_BYTES, remote_timeout="3s", io_threads=2)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        assert s.put(first, make_kv(first)) == len(first)
        assert s.put(second, make_kv(second)) == len(second)  # room beside the writes waiting
        n, out = read(s, second)
        assert n == len(second) and same_bytes(out, make_kv(second))
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        assert s.close(timeout=10)


def _count_calls(tier, name: str) -> list[int]:
    """The batch sizes of ``tier``'s calls of ``name`` from now on (white-box wrap)."""
    sizes: list[int] = []
    inner = getattr(tier, name)

    def counted(batch, *rest):
        sizes.append(len(batch))
        return inner(batch, *rest)

    setattr(tier, name, counted)
    return sizes


@pytest.mark.parametrize("group_chunks, calls", [(6, [6]), (2, [2, 2, 2])])
def test_a_get_reads_its_remote_chunks_in_groups_of_the_tiers_round_trip(server, group_chunks,
                                                                         calls):
    toks = tokens(17)
    with store(server) as a:
        a.put(toks, make_kv(toks))
        assert a.flush(20)
    with store(server, io_threads=4) as b:  # a read window of 8 chunks
        tier = b._state.remote.tier
        tier.read_group_bytes = group_chunks * CHUNK_BYTES
        sizes = _count_calls(tier, "get_many")
        n, out = read(b, toks)
        assert n == len(toks) and same_bytes(out, make_kv(toks))
        assert sizes == calls


def test_writes_go_in_groups_of_the_tiers_round_trip_at_most(server, monkeypatch):
    from kvtier.remote.redis_tier import RedisTier

    monkeypatch.setattr(RedisTier, "put_group_bytes", 3 * CHUNK_BYTES)
    toks = tokens(18, 12)
    with store(server) as a:
        sizes = _count_calls(a._state.remote.tier, "put_many")
        a.put(toks, make_kv(toks))
        assert a.flush(20)
        assert sum(sizes) == 12 and max(sizes) <= 3


def test_flush_writes_a_chunk_other_traffic_crowded_out_of_the_queue(server):
    toks = tokens(19, 4)
    with store(server, remote_min_hits=0) as a:
        remote = a._state.remote
        remote._max_pending = 0  # every write of the put is dropped
        a.put(toks, make_kv(toks))
        assert a.stats().remote_dropped_writes == 4 and not remote_keys(server)
        remote._max_pending = 8
        real, crowded = remote._queue, []

        def queue(held, key, slot):  # the first try of each chunk finds the queue full
            if key not in crowded:
                crowded.append(key)
                return False
            return real(held, key, slot)

        remote._queue = queue
        assert a.flush(20)
        assert len(crowded) == 4 and len(remote_keys(server)) == 4


def test_flush_says_so_when_the_store_is_down_with_chunks_unwritten(server):
    toks = tokens(20, 3)
    with store(server) as a:
        a._state.remote._max_pending = 0
        a.put(toks, make_kv(toks))
        server.stop()
        a._state.remote._max_pending = 8
        assert a.lookup(tokens(21, 1)).tokens == 0  # a failed round trip: out of service
        assert not a.flush(5)


def test_flush_says_so_when_the_store_goes_down_under_its_last_writes(server):
    toks = tokens(22, 3)
    with store(server) as a:
        remote = a._state.remote
        remote._max_pending = 0
        a.put(toks, make_kv(toks))
        remote._max_pending = 8
        inner = remote.tier.put_many

        def put_many(items):  # the store dies as flush's writes go out
            server.stop()
            return inner(items)

        remote.tier.put_many = put_many
        assert not a.flush(10)


def test_with_a_remote_store_disk_writes_queue_a_quarter_of_the_host_slots(server, tmp_path):
    make, engines = FakeEngine.factory()
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 64 * CHUNK_BYTES, "remote_url": server.url,
           "io_threads": 1, "disk_paths": [str(disk)], "disk_capacity": 64 * (4096 + CHUNK_BYTES),
           "disk_min_free": 0}
    try:
        with KVStore(SMALL, cfg, model="m", io_engine=make) as s:
            engines[0].hold("disk0")
            toks = tokens(7, 24)
            s.put(toks, make_kv(toks))  # 16 queued (64 / 4): the remote's writes hold slots too
            assert s.stats().dropped_writes == 24 - 16
            engines[0].release("disk0")
            assert s.flush(timeout=10)
    finally:
        for engine in engines:
            engine.release()


def test_flush_counts_device_pool_chunks_the_store_was_never_sent(server):
    toks = tokens(15, 3)
    with store(server, gpu_capacity=8 * CHUNK_BYTES) as a:  # puts land in the device pool
        a.put(toks, make_kv(toks))
        flushed = a.flush(10)
        assert not flushed and flushed.not_written == 3


def test_a_put_longer_than_host_memory_keeps_its_first_chunks_for_the_remote_store(server):
    """Remote writes go from host slots in the background: a put that evicted its own first
    chunks before their writes would leave the store without the prefix's start."""
    toks = tokens(16, 8)
    with store(server, host_capacity=4 * CHUNK_BYTES) as a:
        assert a.put(toks, make_kv(toks)) == 4 * CHUNK  # what host memory holds
        assert a.flush(20)
    with store(server) as b:
        n, out = read(b, toks)
        assert n == 4 * CHUNK
        assert torch.equal(out[:, :, :n].view(torch.int16), make_kv(toks)[:, :, :n].view(torch.int16))


def test_past_a_chunk_only_the_store_holds_a_chunk_only_this_store_holds_carries_the_prefix_on(server):
    """The prefix walk past what is cached here takes each chunk from here or the store,
    whichever holds it: before, a chunk cached only here ended the hit there."""
    toks = tokens(17)
    with store(server) as a, store(server) as b:
        a.put(toks, make_kv(toks))
        assert a.flush(10)
        b.put(toks[:4 * CHUNK], make_kv(toks[:4 * CHUNK]))
        assert b.flush(10)
        keys = b.keys(toks)
        for key in keys[:2]:
            b._state.books.discard(key)  # evicted from b's host memory
        server.client().delete(*[value_key("kvtier:", b.namespace.digest(), k) for k in keys[2:4]])
        # chunks 0-1 and 4-5 only in the store, 2-3 only in b's host memory
        assert b.lookup(toks).chunks_by_tier == {REMOTE: 4, HOST: 2}
        n, out = read(b, toks)
        assert n == len(toks) and same_bytes(out, make_kv(toks))
        assert b.stats().chunks_loaded == {REMOTE: 4, HOST: 2}
