"""The Mooncake remote tier against a real mooncake_master and holder, all inside a private
network namespace (tests/test_remote_mooncake.py runs this module there), in what is
Mooncake's own: chunks in registered memory moved with no copy (whole, and in part), a value
that fails its checks removed, a hung holder failing the transfer within the timeout, and a
tier that lends memory serving other clients. What every backend promises is
tests/mooncake_inner_contract.py's."""

import time

import numpy as np
import pytest

from kvtier.io.result import IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.mooncake_tier import MooncakeTier
from kvtier.remote.values import VALUE_HEADER_BYTES, value_key
from tests.helpers.mooncake_server import MooncakeServer, inside_namespace

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


@pytest.fixture
def server(tmp_path):
    srv = MooncakeServer(tmp_path / "mooncake").start()
    yield srv
    srv.stop()


@pytest.fixture
def tiers():
    made: list[MooncakeTier] = []
    yield made
    for t in made:
        t.close()


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


def test_chunks_in_registered_memory_move_with_no_copy(server, tiers):
    host = np.zeros(40 * RAW, np.uint8)
    early, late = tier(tiers, server), tier(tiers, server)
    early.register(host)  # before it connects, as a store does
    for i in range(8):
        host[i * RAW:(i + 1) * RAW] = chunk(i)
    assert all(r.ok for r in early.put_many([(key(i), host[i * RAW:(i + 1) * RAW]) for i in range(8)]))
    assert late.exists([key(0)]) == [True]
    late.register(host)  # once connected
    dsts = [host[(10 + i) * RAW:(11 + i) * RAW] for i in range(8)]
    assert all(r.ok for r in late.get_many([key(i) for i in range(8)], dsts))
    assert all(np.array_equal(dsts[i], chunk(i)) for i in range(8))
    assert early.staged == late.staged == 0
    outside = [np.zeros(RAW, np.uint8) for _ in range(2)]  # mixed with registered ones
    results = late.get_many([key(i) for i in range(4)], [outside[0], host[20 * RAW:21 * RAW],
                                                         outside[1], host[21 * RAW:22 * RAW]])
    assert all(r.ok for r in results) and late.staged == 2
    got = [outside[0], host[20 * RAW:21 * RAW], outside[1], host[21 * RAW:22 * RAW]]
    assert all(np.array_equal(got[i], chunk(i)) for i in range(4))


PARTS = (RAW // 4, RAW // 4, RAW // 2)
PART_HEADER = VALUE_HEADER_BYTES + 16 * len(PARTS)  # the part table after the header


def test_chunks_in_parts_in_registered_memory_are_read_in_part(server, tiers):
    t = tier(tiers, server, parts=PARTS)
    host = np.full(8 * RAW, 7, np.uint8)
    t.register(host)
    assert all(r.ok for r in t.put_many([(key(i), chunk(i)) for i in range(3)]))
    raw = server.client()
    name = value_key("kvtier:", NS.digest(), key(0)).decode()
    value = bytearray(raw.get(name))
    assert len(value) == PART_HEADER + RAW
    value[PART_HEADER + RAW // 4 + 9] ^= 0x01  # in a part the first read does not need
    assert raw.remove(name, True) == 0 and raw.put(name, bytes(value)) == 0
    slots = [host[i * RAW:(i + 1) * RAW] for i in range(4)]
    staged = t.staged  # the puts' (their chunks lie outside registered memory)
    results = t.get_parts([key(0), key(1), key(2), key(9)], slots, [{0}, {0, 2}, {1}, {0}])
    assert [r.status for r in results] == [IOStatus.OK] * 3 + [IOStatus.MISSING]
    assert [r.nbytes for r in results[:3]] == [RAW // 4, 3 * RAW // 4, RAW // 4]
    spans = [(0, RAW // 4), (RAW // 4, RAW // 2), (RAW // 2, RAW)]
    for i, parts in enumerate([{0}, {0, 2}, {1}]):
        for p, (at, end) in enumerate(spans):
            want = chunk(i)[at:end] if p in parts else np.full(end - at, 7, np.uint8)
            assert np.array_equal(slots[i][at:end], want), (i, p)
    assert t.staged == staged  # read into the host slots, no copy
    (bad,) = t.get_parts([key(0)], [slots[0]], [{1}])  # the damaged part, read: a miss
    assert bad.status is IOStatus.CORRUPT and t.exists([key(0)]) == [False]  # and removed
    (whole,) = t.get_parts([key(1)], [np.zeros(RAW, np.uint8)], [{0}])  # not registered
    assert whole.ok and t.staged == staged + 1  # read whole, through the scratch
    plain = tier(tiers, server)  # a tier of whole chunks refuses a value in parts
    assert get(plain, [key(2)])[0][0].status is IOStatus.CORRUPT


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


def test_a_tier_that_lends_memory_serves_other_clients(server, tiers):
    lender = MooncakeTier(f"{server.url}?segment=32MiB&protocol=tcp", NS, RAW, timeout_s=1.0, retry_s=0.3)
    tiers.append(lender)
    assert all(r.ok for r in lender.put_many([(key(i), chunk(i)) for i in range(8)]))
    results, dsts = get(tier(tiers, server), [key(i) for i in range(8)])
    assert all(r.ok for r in results) and all(np.array_equal(dsts[i], chunk(i)) for i in range(8))
