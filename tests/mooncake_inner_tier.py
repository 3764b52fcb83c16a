"""The Mooncake remote tier against a real mooncake_master and holder, all inside a private
network namespace (tests/test_remote_mooncake.py runs this module there): batched round
trips, every value verified (a damaged, truncated, foreign or evicted value is a miss, never
wrong bytes), chunks in registered memory moved with no copy, and a master that is down,
hung or full answering results, never exceptions, within the timeout."""

import threading
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


def test_batches_round_trip_byte_for_byte_and_exist(server, tiers):
    t = tier(tiers, server)
    for at in range(0, 32, 8):
        assert all(r.ok for r in t.put_many([(key(i), chunk(i)) for i in range(at, at + 8)]))
    assert t.exists([key(i) for i in range(34)]) == [True] * 32 + [False] * 2
    results, dsts = get(t, [key(i) for i in range(34)])
    assert [r.status for r in results] == [IOStatus.OK] * 32 + [IOStatus.MISSING] * 2
    assert all(np.array_equal(dsts[i], chunk(i)) for i in range(32))
    assert t.staged == 32 + 34  # unregistered buffers: each copied through the scratch


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


def test_threads_share_a_tier(server, tiers):
    t = tier(tiers, server)
    host = np.zeros(64 * RAW, np.uint8)
    t.register(host)
    wrong: list[int] = []

    def work(w: int) -> None:
        for i in range(w * 8, w * 8 + 8):
            src, dst = host[i * RAW:(i + 1) * RAW], host[(32 + i) * RAW:(33 + i) * RAW]
            src[:] = chunk(i)
            if not (t.put_many([(key(i), src)])[0].ok and t.get_many([key(i)], [dst])[0].ok
                    and np.array_equal(dst, chunk(i))):
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert wrong == [] and t.staged == 0


def test_namespaces_share_one_store_without_seeing_each_other(server, tiers):
    other = Namespace(model="other", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
    a, b = tier(tiers, server), tier(tiers, server, other)
    assert a.put_many([(key(1), chunk(1))])[0].ok
    assert b.exists([key(1)]) == [False]
    assert get(b, [key(1)])[0][0].status is IOStatus.MISSING


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


def test_a_value_of_another_layout_read_in_part_is_a_miss(server, tiers):
    t, plain = tier(tiers, server, parts=PARTS), tier(tiers, server)
    host = np.zeros(2 * RAW, np.uint8)
    t.register(host)
    assert plain.put_many([(key(1), chunk(1))])[0].ok  # whole: no part table
    (result,) = t.get_parts([key(1)], [host[:RAW]], [{2}])
    assert result.status is IOStatus.CORRUPT, result


@pytest.mark.parametrize("damage", ["flip payload", "flip header", "truncate", "other chunk",
                                    "not kvtier's", "longer"])
def test_a_damaged_value_is_a_miss_never_wrong_bytes_and_is_replaced(server, tiers, damage):
    t = tier(tiers, server)
    t.put_many([(key(1), chunk(1)), (key(2), chunk(2))])
    raw = server.client()
    name = value_key("kvtier:", NS.digest(), key(1)).decode()
    value = bytearray(raw.get(name))
    assert len(value) == VALUE_HEADER_BYTES + RAW
    if damage == "flip payload":
        value[VALUE_HEADER_BYTES + 1000] ^= 0xFF
    elif damage == "flip header":
        value[40] ^= 0x01
    elif damage == "truncate":
        value = value[: len(value) // 2]
    elif damage == "other chunk":
        value = bytearray(raw.get(value_key("kvtier:", NS.digest(), key(2)).decode()))
    elif damage == "longer":
        value += b"\0" * 100
    else:
        value = bytearray(b"hello")
    assert raw.remove(name, True) == 0 and raw.put(name, bytes(value)) == 0
    (result,), (dst,) = get(t, [key(1)])
    assert result.status is IOStatus.CORRUPT, result
    (good,), (dst,) = get(t, [key(2)])
    assert good.ok and np.array_equal(dst, chunk(2))
    assert t.exists([key(1)]) == [False]  # removed, so that a put stores it again
    assert t.put_many([(key(1), chunk(1))])[0].ok
    (healed,), (dst,) = get(t, [key(1)])
    assert healed.ok and np.array_equal(dst, chunk(1))


def test_wrong_sizes_are_refused(server, tiers):
    t = tier(tiers, server)
    assert t.put_many([(key(1), np.zeros(RAW - 1, np.uint8))])[0].status is IOStatus.IO_ERROR
    assert t.get_many([key(1)], [np.zeros(RAW // 2, np.uint8)])[0].status is IOStatus.IO_ERROR
    assert t.get_many([key(1)], [np.zeros(2 * RAW, np.uint8)[::2]])[0].status is IOStatus.IO_ERROR
    assert not t.down and t.exists([key(1)]) == [False]


def test_a_full_store_refuses_or_evicts_never_wrong_bytes(tmp_path, tiers):
    srv = MooncakeServer(tmp_path / "small", 16 * 2**20).start()  # room for 255 values
    try:
        t = tier(tiers, srv)
        statuses = [r.status for at in range(0, 320, 32)
                    for r in t.put_many([(key(i), chunk(i)) for i in range(at, at + 32)])]
        assert set(statuses) <= {IOStatus.OK, IOStatus.NO_SPACE} and not t.down
        results, dsts = get(t, [key(i) for i in range(320)])
        hits = [i for i, r in enumerate(results) if r.ok]
        assert 0 < len(hits) < 320, statuses
        assert {r.status for r in results} <= {IOStatus.OK, IOStatus.MISSING}
        assert all(np.array_equal(dsts[i], chunk(i)) for i in hits)
    finally:
        srv.stop()


def test_a_master_killed_is_a_failure_then_out_of_service_then_back(server, tiers):
    t = tier(tiers, server)
    assert t.put_many([(key(1), chunk(1))])[0].ok
    server.kill_master()
    started = time.monotonic()
    (result,), _ = get(t, [key(2)])  # a key not held: only the master can say so
    assert result.status in FAILED and t.down, result
    assert get(t, [key(1)])[0][0].status is IOStatus.PATH_DOWN  # no trip while out of service
    assert t.put_many([(key(2), chunk(2))])[0].status is IOStatus.PATH_DOWN
    assert t.exists([key(1)]) == [False]
    assert time.monotonic() - started < 6
    time.sleep(0.35)  # retry due, master still dead: refused before any call of the client
    started = time.monotonic()
    assert get(t, [key(1)])[0][0].status in FAILED and time.monotonic() - started < 1.1
    server.start()  # master and holder restarted, empty, on the same port
    results = until(lambda: get(t, [key(1)])[0], lambda r: r[0].status is IOStatus.MISSING, 15)
    assert results[0].status is IOStatus.MISSING
    assert t.put_many([(key(1), chunk(1))])[0].ok
    (back,), (dst,) = get(t, [key(1)])
    assert back.ok and np.array_equal(dst, chunk(1))


def test_a_master_down_at_start_is_a_failure_not_an_error(tmp_path, tiers):
    srv = MooncakeServer(tmp_path / "late")  # its port chosen, nothing listening yet
    t = tier(tiers, srv)
    started = time.monotonic()
    assert t.put_many([(key(1), chunk(1))])[0].status in FAILED
    assert time.monotonic() - started < 1.1 and t.down
    srv.start()
    try:
        put = until(lambda: t.put_many([(key(1), chunk(1))]), lambda r: r[0].ok, 15)
        assert put[0].ok and get(t, [key(1)])[0][0].ok
    finally:
        srv.stop()


def test_a_hung_master_times_out_within_the_timeout(server, tiers):
    t = tier(tiers, server)
    t.put_many([(key(1), chunk(1))])
    server.pause(server.master)  # connections open, no replies
    try:
        started = time.monotonic()
        (result,), _ = get(t, [key(2)])  # a key not held: only the master can say so
        assert result.status is IOStatus.TIMED_OUT and time.monotonic() - started < 1.6
    finally:
        server.resume(server.master)
    results = until(lambda: get(t, [key(1)]), lambda r: r[0][0].ok, 10)
    assert results[0][0].ok and np.array_equal(results[1][0], chunk(1))


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


def test_close_takes_the_tier_out_of_service(server, tiers):
    t = tier(tiers, server)
    assert t.put_many([(key(1), chunk(1))])[0].ok
    t.close()
    assert get(t, [key(1)])[0][0].status is IOStatus.PATH_DOWN
    assert t.put_many([(key(1), chunk(1))])[0].status is IOStatus.PATH_DOWN
    assert t.exists([key(1)]) == [False] and t.down


def test_a_tier_that_lends_memory_serves_other_clients(server, tiers):
    lender = MooncakeTier(f"{server.url}?segment=32MiB&protocol=tcp", NS, RAW, timeout_s=1.0, retry_s=0.3)
    tiers.append(lender)
    assert all(r.ok for r in lender.put_many([(key(i), chunk(i)) for i in range(8)]))
    results, dsts = get(tier(tiers, server), [key(i) for i in range(8)])
    assert all(r.ok for r in results) and all(np.array_equal(dsts[i], chunk(i)) for i in range(8))
