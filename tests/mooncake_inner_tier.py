"""The Mooncake remote tier against a real mooncake_master and holder, all inside a private
network namespace (tests/test_remote_mooncake.py runs this module there), in what is
Mooncake's own: a hung holder fails the transfer within the timeout, and a tier that lends
memory serves other clients. What every backend promises (Mooncake's chunks in registered
memory moving with no copy among it) is tests/mooncake_inner_contract.py's."""

import threading
import time

import numpy as np
import pytest

from kvtier.io.result import IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.mooncake_tier import MooncakeTier
from tests.helpers.mooncake_server import inside_namespace

pytest_plugins = ["tests.helpers.mooncake_fixtures"]  # server, tiers

if not inside_namespace():
    pytest.skip("runs only inside a private network namespace: tests/test_remote_mooncake.py "
                "starts it there", allow_module_level=True)

RAW = 64 * 1024
NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
FAILED = (IOStatus.IO_ERROR, IOStatus.TIMED_OUT)


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, RAW, dtype=np.uint8)


def tier(made, server, namespace=NS, **options) -> MooncakeTier:
    t = MooncakeTier(server.url, namespace, RAW, **{"timeout_s": 1.0, "retry_s": 0.3, **options})
    made.append(t)
    return t


def get(t: MooncakeTier, keys):
    dsts = [np.zeros(RAW, np.uint8) for _ in keys]
    return t.get_many(keys, dsts), dsts


def until(call, done, limit_s: float):
    """``call()`` again every 0.1 s until ``done(result)``, for ``limit_s`` at most."""
    deadline = time.monotonic() + limit_s
    while True:
        result = call()
        if done(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.1)


def test_a_hung_holder_fails_the_transfer_within_the_timeout(server, tiers):
    t = tier(tiers, server)
    t.put_many([(key(1), chunk(1))])
    server.pause(server.holder)
    try:
        started = time.monotonic()
        (result,), _ = get(t, [key(1)])
        assert result.status in FAILED and time.monotonic() - started < 2.5
    finally:
        server.resume(server.holder)
    results = until(lambda: get(t, [key(1)]), lambda r: r[0][0].ok, 10)
    assert results[0][0].ok and np.array_equal(results[1][0], chunk(1))


def test_a_hung_holder_takes_the_tier_out_of_service_within_one_deadline(server, tiers):
    """The client waits its progress timeout per chunk, one after another (8 chunks: about
    8 s): the tier is out of service one ``timeout_s`` after the call began, so the calls
    behind it fail at once, while the late call keeps its buffers until it ends."""
    t = tier(tiers, server)
    keys = [key(i) for i in range(8)]
    assert all(r.ok for r in t.put_many([(k, chunk(i)) for i, k in enumerate(keys)]))
    server.pause(server.holder)
    answer: list = []
    try:
        started = time.monotonic()
        slow = threading.Thread(target=lambda: answer.append(get(t, keys)))
        slow.start()
        while not t.down and time.monotonic() - started < 5:
            time.sleep(0.02)
        out_at = time.monotonic() - started
        (other,), _ = get(t, [key(1)])
        assert t.down and out_at < 2.0 and slow.is_alive(), (out_at, slow.is_alive())
        assert other.status is IOStatus.PATH_DOWN
        slow.join(30)
        assert answer and all(not r.ok for r in answer[0][0])
    finally:
        server.resume(server.holder)
    results = until(lambda: get(t, [key(1)]), lambda r: r[0][0].ok, 10)
    assert results[0][0].ok and np.array_equal(results[1][0], chunk(1))


def test_a_dead_holder_costs_its_own_keys_while_the_other_holder_serves_its(server, tiers, monkeypatch):
    """Two holders; one is killed. Until the master drops its segment, every get of its keys
    fails its transfer: that holder goes out of service alone, its keys answered PATH_DOWN
    unread (and no lookup promises them), while the other holder's keys are served with
    their bytes and the tier stays in service (before, each failed transfer took the whole
    tier out). A failed transfer takes the progress timeout (1 s here), within the deadline."""
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "1")
    second = server.another_holder()
    t = tier(tiers, server, timeout_s=3.0, retry_s=30.0)  # no trial of the dead holder meanwhile
    keys = [key(i) for i in range(24)]
    assert all(r.ok for r in t.put_many([(k, chunk(i)) for i, k in enumerate(keys)]))
    found = server.client().batch_get_replica_desc(t._names(keys))
    holder_of = [next(iter(holders_of_replicas(found[name]))) for name in t._names(keys)]
    assert len(set(holder_of)) == 2, "the values should spread over both holders"
    second.kill()
    second.wait(10)
    first, _ = get(t, keys)  # fails the dead holder's transfers
    dead = {holder_of[i] for i, r in enumerate(first) if r.status in FAILED}
    assert len(dead) == 1 and not t.down, [r.status for r in first]
    results, dsts = get(t, keys)
    assert not t.down and t.nodes_out() == sorted(dead)
    held = t.exists_answered(keys)
    assert held is not None
    for i, (result, dst) in enumerate(zip(results, dsts, strict=True)):
        if holder_of[i] in dead:
            assert result.status is IOStatus.PATH_DOWN and "holder" in result.detail, result
            assert held[i] is None
        else:
            assert result.ok and np.array_equal(dst, chunk(i)), result
            assert held[i] is True


def holders_of_replicas(replicas) -> set[str]:
    return {r.get_memory_descriptor().buffer_descriptor.transport_endpoint
            for r in replicas if r.is_memory_replica()}


def test_a_paused_master_answers_a_lookup_within_one_deadline(server, tiers):
    t = tier(tiers, server)
    t.put_many([(key(1), chunk(1))])
    server.pause(server.master)
    try:
        started = time.monotonic()
        assert t.exists([key(1)]) == [False]
        assert time.monotonic() - started < 2.0 and t.down
    finally:
        server.resume(server.master)


def test_a_tier_that_lends_memory_serves_other_clients(server, tiers):
    lender = MooncakeTier(f"{server.url}?segment=32MiB&protocol=tcp", NS, RAW, timeout_s=1.0, retry_s=0.3)
    tiers.append(lender)
    assert all(r.ok for r in lender.put_many([(key(i), chunk(i)) for i in range(8)]))
    results, dsts = get(tier(tiers, server), [key(i) for i in range(8)])
    assert all(r.ok for r in results) and all(np.array_equal(dsts[i], chunk(i)) for i in range(8))
