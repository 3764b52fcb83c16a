"""One test suite for the contract of ``kvtier.remote.base.RemoteTier`` (its docstring), run
against every backend: ``tests/test_remote_contract.py`` (Valkey/Redis, one server and a
cluster) and ``tests/mooncake_inner_contract.py`` (Mooncake Store, in a private network
namespace). A backend's class subclasses ``RemoteContract`` and gives a class-scoped
``shared_store`` fixture (a ``remote_stores.ContractStore``); ``broken`` names the tests of
a promise that backend is known to break (strict xfail, with the reason).

What it checks, each promise on a real store:

- batches: one result per key, in order; a chunk put is read back byte for byte; a key never
  put, or gone from the store, is ``MISSING`` and ``exists`` says False, never an exception;
  empty batches answer empty (before connecting and after); the smallest and a large chunk
  round-trip;
- a second put of a key it holds is not a failure, and a read gives one whole chunk;
- namespaces and prefixes share a store without seeing each other;
- a value truncated, damaged, longer, another chunk's, another namespace's, another layout's
  or not kvtier's is ``CORRUPT`` (never wrong bytes, the batch stays in step), and a put
  then replaces it;
- ``get_parts`` fills the parts wanted, each checked, in registered memory or not, and a
  put replaces a value that failed them;
- ``register``: chunks in registered memory, registered before or after connecting, move
  with no copy (where the backend counts its copies);
- a buffer the tier cannot read into, or a chunk of the wrong size, fails that call only;
- threads share a tier;
- ``close``: later calls answer ``PATH_DOWN``;
- health: a store down is a failed round trip, then ``PATH_DOWN`` for ``retry_s`` (logged
  once going and once back), then tried again; a store down when the tier is made is a
  failure, never an error; a hung store costs a call about ``timeout_s``; a full store
  refuses or evicts, never serves wrong bytes, and stays in service.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import numpy as np
import pytest

from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.base import RemoteTier
from kvtier.remote.values import INDEX_ENTRY_BYTES, VALUE_HEADER_BYTES, ValueFormat
from tests.helpers.remote_stores import NS, RAW, RETRY_S, ContractStore

T = TypeVar("T")
PARTS = (8192, 24576, 16384, 16384)  # a full group's part, then sliding ones: RAW in all
SPANS = ValueFormat(NS.digest(), RAW, PARTS).spans
PART_HEADER = VALUE_HEADER_BYTES + 16 * len(PARTS)  # the header, then the part table
OTHER = Namespace(model="other", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
FAILED = {IOStatus.IO_ERROR, IOStatus.TIMED_OUT}


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def chunk(i: int, nbytes: int = RAW) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


# keys none of the tests puts, on every node of a cluster: a cluster's tier goes out of
# service once every node failed (a node failing alone costs its own keys only)
SPREAD = [key(2), *[key(1000 + i) for i in range(31)]]


def get(tier: RemoteTier, keys: list[ChunkKey], nbytes: int = RAW) -> tuple[list[IOResult], list[np.ndarray]]:
    dsts = [np.zeros(nbytes, np.uint8) for _ in keys]
    return tier.get_many(keys, dsts), dsts


def statuses(results: list[IOResult]) -> list[IOStatus]:
    return [r.status for r in results]


def until(call: Callable[[], T], done: Callable[[T], bool], limit_s: float) -> T:
    """``call()`` every 0.1 s until ``done(result)``, for ``limit_s`` at most."""
    deadline = time.monotonic() + limit_s
    while True:
        result = call()
        if done(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.1)


def timed(call: Callable[[], T]) -> tuple[T, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def check_parts(dst: np.ndarray, i: int, wanted: set[int]) -> None:
    for p in wanted:
        at, end = SPANS[p]
        assert np.array_equal(dst[at:end], chunk(i)[at:end]), f"part {p} of chunk {i}"


def damaged(store: ContractStore, how: str, name: bytes, neighbour: bytes) -> bytes | None:
    """The value under ``name`` damaged ``how`` (None: dropped)."""
    value = bytearray(store.raw_get(name) or b"")
    assert value, f"the store holds no value under {name!r}"
    header = len(value) - RAW  # a whole chunk's or a chunk in parts'
    if how == "flip payload":
        value[header + 1000] ^= 0xFF
    elif how == "flip header":
        value[40] ^= 0x01
    elif how == "truncate":
        value = value[: len(value) // 2]
    elif how == "longer":
        value += b"\0" * 100
    elif how == "other chunk":
        value = bytearray(store.raw_get(neighbour) or b"")
    elif how == "not kvtier's":
        value = bytearray(b"hello")
    elif how == "part read":
        value[header + SPANS[0][0] + 100] ^= 1
    elif how == "part not read":
        value[header + SPANS[1][0] + 100] ^= 1
    elif how == "table":
        value[INDEX_ENTRY_BYTES + 20] ^= 1
    elif how == "truncated in a part read":
        value = value[:header + SPANS[2][0] + 10]
    elif how == "gone":
        return None
    else:
        raise AssertionError(how)
    return bytes(value)


def spoil(store: ContractStore, how: str, name: bytes, neighbour: bytes) -> None:
    value = damaged(store, how, name, neighbour)
    if value is None:
        store.raw_delete(name)
    else:
        store.raw_set(name, value)


class RemoteContract:
    """The tests every ``RemoteTier`` backend passes (see the module's docstring)."""

    broken: ClassVar[dict[str, str]] = {}  # test name: the promise the backend breaks, and how

    @pytest.fixture
    def store(self, shared_store: ContractStore, request: Any):
        reason = self.broken.get(request.node.originalname)
        if reason:
            request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
        shared_store.begin()
        yield shared_store
        shared_store.end()

    # -- batches, sizes, keys --------------------------------------------------------------

    def test_a_batch_round_trips_byte_for_byte_one_result_per_key_in_order(self, store):
        t = store.tier(parts=PARTS)
        assert t.put_many([]) == [] and t.exists([]) == [] and t.get_many([], []) == []  # empty
        put = t.put_many([(key(i), chunk(i)) for i in range(8)])
        assert statuses(put) == [IOStatus.OK] * 8
        assert t.put_many([]) == [] and t.exists([]) == [] and t.get_many([], []) == []
        assert t.get_parts([], [], []) == []
        assert t.exists([key(9), *[key(i) for i in range(8)], key(8)]) == [False] + [True] * 8 + [False]
        order = [5, 9, 0, 7, 3, 8, 1, 6, 2, 4]
        results, dsts = get(t, [key(i) for i in order])
        assert statuses(results) == [IOStatus.MISSING if i > 7 else IOStatus.OK for i in order]
        for i, result, dst in zip(order, results, dsts, strict=True):
            assert i > 7 or (result.nbytes == RAW and np.array_equal(dst, chunk(i))), i
        assert not t.down and t.failures == 0  # misses are answers, not failures
        store.raw_delete(store.name(key(3)))  # gone from the store, as an eviction would do
        assert statuses(get(t, [key(3), key(4)])[0]) == [IOStatus.MISSING, IOStatus.OK]
        assert t.get_parts([key(3)], [np.zeros(RAW, np.uint8)], [{0}])[0].status is IOStatus.MISSING
        assert t.exists([key(3), key(4)]) == [False, True] and t.failures == 0

    @pytest.mark.parametrize("nbytes", [1, 8 * 2**20])
    def test_the_smallest_and_a_large_chunk_round_trip(self, store, nbytes):
        t = store.tier(raw_bytes=nbytes, timeout_s=max(store.timeout_s, 5.0))
        assert statuses(t.put_many([(key(i), chunk(i, nbytes)) for i in range(3)])) == [IOStatus.OK] * 3
        results, dsts = get(t, [key(i) for i in range(4)], nbytes)
        assert statuses(results) == [IOStatus.OK] * 3 + [IOStatus.MISSING]
        assert all(np.array_equal(dsts[i], chunk(i, nbytes)) for i in range(3))
        bigger = np.zeros(nbytes + 4096, np.uint8)  # a buffer larger than a chunk takes one
        assert t.get_many([key(2)], [bigger])[0].ok and np.array_equal(bigger[:nbytes], chunk(2, nbytes))

    def test_a_second_put_of_a_key_held_is_no_failure_and_a_read_gives_one_whole_chunk(self, store):
        t = store.tier()
        assert t.put_many([(key(1), chunk(1)), (key(2), chunk(2))])[0].ok
        again = t.put_many([(key(1), chunk(1)), (key(2), chunk(3))])  # the same bytes; others
        assert statuses(again) == [IOStatus.OK] * 2
        results, dsts = get(t, [key(1), key(2)])
        assert statuses(results) == [IOStatus.OK] * 2 and np.array_equal(dsts[0], chunk(1))
        assert np.array_equal(dsts[1], chunk(2)) or np.array_equal(dsts[1], chunk(3))

    def test_a_removed_value_is_gone_and_others_stay(self, store):
        t = store.tier()
        assert statuses(t.put_many([(key(i), chunk(i)) for i in range(3)])) == [IOStatus.OK] * 3
        assert t.remove([key(0), key(2), key(7)])  # one never put: no failure
        assert t.exists([key(0), key(1), key(2)]) == [False, True, False]
        assert statuses(get(t, [key(0), key(1)])[0]) == [IOStatus.MISSING, IOStatus.OK]
        assert t.remove([]) and t.failures == 0
        assert statuses(t.put_many([(key(0), chunk(0))])) == [IOStatus.OK]  # may be put again
        assert get(t, [key(0)])[0][0].ok

    def test_namespaces_and_prefixes_share_a_store_without_seeing_each_other(self, store):
        a, b, c = store.tier(), store.tier(namespace=OTHER), store.tier(prefix=store.prefix + "x:")
        assert a.put_many([(key(1), chunk(1))])[0].ok
        for other in (b, c):
            assert other.exists([key(1)]) == [False]
            assert get(other, [key(1)])[0][0].status is IOStatus.MISSING
        assert b.put_many([(key(1), chunk(2))])[0].ok and c.put_many([(key(1), chunk(3))])[0].ok
        for other, i in ((a, 1), (b, 2), (c, 3)):
            (result,), (dst,) = get(other, [key(1)])
            assert result.ok and np.array_equal(dst, chunk(i))

    # -- values that fail their checks ---------------------------------------------------------

    WHOLE_DAMAGE = ("flip payload", "flip header", "truncate", "longer", "other chunk",
                    "not kvtier's", "another namespace's", "another layout's")

    def test_a_damaged_value_is_corrupt_never_wrong_bytes_and_a_put_replaces_it(self, store):
        t = store.tier()
        n = len(self.WHOLE_DAMAGE)
        assert all(r.ok for r in t.put_many([(key(i), chunk(i)) for i in range(n + 2)]))
        for i, how in enumerate(self.WHOLE_DAMAGE):
            name = store.name(key(i))
            if how == "another namespace's":  # its value of the same chunk, under this key
                assert store.tier(namespace=OTHER).put_many([(key(i), chunk(i))])[0].ok
                store.raw_set(name, store.raw_get(store.name(key(i), OTHER)) or b"")
            elif how == "another layout's":  # the same chunk stored in parts, by another tier
                store.raw_delete(name)
                assert store.tier(parts=PARTS).put_many([(key(i), chunk(i))])[0].ok
            else:
                spoil(store, how, name, store.name(key(n)))
        order = [n, *range(n), n + 2, n + 1]  # good ones around them, and a key never put
        results, dsts = get(t, [key(i) for i in order])
        expected = [IOStatus.OK, *[IOStatus.CORRUPT] * n, IOStatus.MISSING, IOStatus.OK]
        assert statuses(results) == expected, list(zip(["good", *self.WHOLE_DAMAGE, "missing", "good"],
                                                       results, strict=True))
        assert np.array_equal(dsts[0], chunk(n)) and np.array_equal(dsts[-1], chunk(n + 1))
        assert not t.down and t.failures == 0
        assert all(r.ok for r in t.put_many([(key(i), chunk(i)) for i in range(n)]))
        results, dsts = get(t, [key(i) for i in range(n)])
        assert all(r.ok for r in results), list(zip(self.WHOLE_DAMAGE, results, strict=True))
        assert all(np.array_equal(dsts[i], chunk(i)) for i in range(n))

    PART_DAMAGE = ("part read", "part not read", "table", "truncated in a part read", "gone",
                   "other chunk", "whole layout")

    @pytest.mark.parametrize("registered", [True, False], ids=["registered", "plain"])
    def test_a_read_in_part_fills_the_parts_wanted_each_checked(self, store, registered):
        t, whole = store.tier(parts=PARTS), store.tier()
        host = np.full(16 * RAW, 7, np.uint8)
        if registered:
            t.register(host)
        n = len(self.PART_DAMAGE)
        assert all(r.ok for r in t.put_many([(key(i), chunk(i)) for i in range(2 * n + 1)]))
        for i, how in enumerate(self.PART_DAMAGE):
            if how == "whole layout":  # the same chunk stored whole, with no part table
                store.raw_delete(store.name(key(i)))
                assert whole.put_many([(key(i), chunk(i))])[0].ok
            else:
                spoil(store, how, store.name(key(i)), store.name(key(2 * n)))
        wanted = [{0, 2}] * n + [{0}, {0, 2}, {1, 3}, {3}, set(range(4)), {2}, {1}][:n]
        keys = [key(i) for i in range(2 * n)]
        slots = [host[i * RAW:(i + 1) * RAW] for i in range(2 * n)]
        copies = store.copies(t)
        results = t.get_parts(keys, slots, wanted)
        expected = {"part not read": {IOStatus.OK, IOStatus.CORRUPT}, "gone": {IOStatus.MISSING}}
        for how, result in zip(self.PART_DAMAGE, results, strict=False):
            assert result.status in expected.get(how, {IOStatus.CORRUPT}), (how, result)
        if results[1].ok:  # read in part: the damage was not read, the parts read are right
            check_parts(slots[1], 1, wanted[1])
            (whole_read,) = t.get_many([key(1)], [host[15 * RAW:]])
            assert whole_read.status is IOStatus.CORRUPT  # read whole: every part checked
        for i in range(n, 2 * n):  # good ones
            assert results[i].ok, (i, results[i])
            check_parts(slots[i], i, wanted[i])
            read = sum(SPANS[p][1] - SPANS[p][0] for p in wanted[i])
            assert results[i].nbytes in (read, RAW), (i, results[i])  # the bytes read
        if registered and copies is not None:  # read into the host slots, with no copy
            assert store.copies(t) == copies
        assert not t.down and t.failures == 0
        assert all(r.ok for r in t.put_many([(key(i), chunk(i)) for i in range(n)]))  # replaced
        got = [np.zeros(RAW, np.uint8) for _ in range(n)]
        assert all(r.ok for r in t.get_many(keys[:n], got)) and all(
            np.array_equal(got[i], chunk(i)) for i in range(n))
        other = store.tier(parts=(RAW // 2, RAW // 2))  # another layout of parts
        assert other.get_parts([key(n)], [np.zeros(RAW, np.uint8)], [{1}])[0].status is IOStatus.CORRUPT
        assert get(whole, [key(n + 1)])[0][0].status is IOStatus.CORRUPT

    # -- memory, buffers, threads ----------------------------------------------------------------

    def test_chunks_in_registered_memory_round_trip(self, store):
        host = np.zeros(24 * RAW, np.uint8)
        early, late = store.tier(), store.tier()
        early.register(host)  # before it connects
        for i in range(8):
            host[i * RAW:(i + 1) * RAW] = chunk(i)
        assert all(r.ok for r in early.put_many([(key(i), host[i * RAW:(i + 1) * RAW]) for i in range(8)]))
        assert late.exists([key(0)]) == [True]
        late.register(host)  # once connected
        dsts = [host[(10 + i) * RAW:(11 + i) * RAW] for i in range(8)]
        assert all(r.ok for r in late.get_many([key(i) for i in range(8)], dsts))
        assert all(np.array_equal(dsts[i], chunk(i)) for i in range(8))
        assert store.copies(early) in (0, None) and store.copies(late) in (0, None)  # no copy
        outside = [np.zeros(RAW, np.uint8) for _ in range(2)]  # mixed with registered ones
        got = [outside[0], host[20 * RAW:21 * RAW], outside[1], host[21 * RAW:22 * RAW]]
        assert all(r.ok for r in late.get_many([key(i) for i in range(4)], got))
        assert all(np.array_equal(got[i], chunk(i)) for i in range(4))
        assert store.copies(late) in (2, None)  # those outside: copied

    def test_a_buffer_the_tier_cannot_read_into_fails_that_call_only(self, store):
        t = store.tier(parts=PARTS)
        assert t.put_many([(key(1), chunk(1))])[0].ok
        for dst in (np.zeros(2 * RAW, np.uint8)[::2], np.zeros(RAW // 2, np.uint8)):
            assert t.get_many([key(1)], [dst])[0].status is IOStatus.IO_ERROR
            assert t.get_parts([key(1)], [dst], [{1}])[0].status is IOStatus.IO_ERROR
            assert not dst.any()
        for size in (RAW - 1, RAW + 1, 0):
            assert t.put_many([(key(2), np.zeros(size, np.uint8))])[0].status is IOStatus.IO_ERROR
        assert t.failures == 0 and not t.down and t.exists([key(2)]) == [False]
        (result,), (dst,) = get(t, [key(1)])
        assert result.ok and np.array_equal(dst, chunk(1))

    def test_a_read_only_buffer_fails_that_call_only(self, store):
        t = store.tier(parts=PARTS)
        assert t.put_many([(key(1), chunk(1))])[0].ok
        read_only = np.zeros(RAW, np.uint8)
        read_only.flags.writeable = False
        assert t.get_many([key(1)], [read_only])[0].status is IOStatus.IO_ERROR
        assert t.get_parts([key(1)], [read_only], [{1}])[0].status is IOStatus.IO_ERROR
        assert not read_only.any() and t.failures == 0 and not t.down

    def test_threads_share_a_tier(self, store):
        t = store.tier()
        host = np.zeros(64 * RAW, np.uint8)
        t.register(host)
        wrong: list[int] = []

        def work(w: int) -> None:
            for i in range(w * 8, w * 8 + 8):
                src, dst = host[i * RAW:(i + 1) * RAW], host[(32 + i) * RAW:(33 + i) * RAW]
                src[:] = chunk(i)
                plain = np.zeros(RAW, np.uint8)
                if not (t.put_many([(key(i), src)])[0].ok and t.exists([key(i)]) == [True]
                        and t.get_many([key(i)], [dst])[0].ok and np.array_equal(dst, chunk(i))
                        and t.get_many([key(i)], [plain])[0].ok and np.array_equal(plain, chunk(i))):
                    wrong.append(i)

        threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads) and wrong == []

    # -- close, health ------------------------------------------------------------------

    def test_a_closed_tier_answers_path_down(self, store):
        t = store.tier(parts=PARTS)
        assert t.put_many([(key(1), chunk(1))])[0].ok
        t.close()
        assert t.down and t.exists([key(1)]) == [False]
        assert get(t, [key(1)])[0][0].status is IOStatus.PATH_DOWN
        assert t.get_parts([key(1)], [np.zeros(RAW, np.uint8)], [{0}])[0].status is IOStatus.PATH_DOWN
        assert t.put_many([(key(2), chunk(2))])[0].status is IOStatus.PATH_DOWN
        assert store.tier().exists([key(1), key(2)]) == [True, False]  # the store is fine

    def test_a_store_down_fails_a_trip_then_is_out_of_service_then_tried_again(self, store, caplog):
        caplog.set_level(logging.DEBUG, logger="kvtier")
        t = store.tier(parts=PARTS)
        assert t.put_many([(key(1), chunk(1))])[0].ok
        down_s = min(store.timeout_s + 1, 3.0)  # a store down refuses at once: no waiting it out
        store.stop()
        late = store.tier()  # made while the store is down: a failure, never an error
        (refused,), took = timed(lambda: late.put_many([(key(3), chunk(3))]))
        assert refused.status in FAILED and late.down and took < down_s, (refused, took)
        caplog.clear()
        results, took = timed(lambda: get(t, SPREAD)[0])  # not held: only the store says so
        assert set(statuses(results)) <= FAILED and t.down and t.failures == 1, results
        assert took < down_s
        assert get(t, [key(1)])[0][0].status is IOStatus.PATH_DOWN  # no trip while out
        assert t.get_parts([key(1)], [np.zeros(RAW, np.uint8)], [{0}])[0].status is IOStatus.PATH_DOWN
        assert t.put_many([(key(2), chunk(2))])[0].status is IOStatus.PATH_DOWN
        assert t.exists([key(1)]) == [False] and t.failures == 1
        time.sleep(RETRY_S + 0.05)
        assert not t.down  # tried again
        again, took = timed(lambda: t.get_parts([key(1), *SPREAD], [np.zeros(RAW, np.uint8)] * 33,
                                                [{0}] + [{1}] * 32))
        assert set(statuses(again)) <= FAILED and t.down and t.failures == 2, again
        assert took < down_s
        store.start()  # empty, at the same address
        results = until(lambda: get(t, [key(1)])[0], lambda r: r[0].status is IOStatus.MISSING, 20)
        assert results[0].status is IOStatus.MISSING, results
        assert t.put_many([(key(1), chunk(1))])[0].ok
        (back,), (dst,) = get(t, [key(1)])
        assert back.ok and np.array_equal(dst, chunk(1))
        records = [r for r in caplog.records if r.name == "kvtier" and t.describe() in r.getMessage()
                   and r.levelno >= logging.INFO]
        assert [r.levelno for r in records] == [logging.WARNING, logging.INFO]
        assert "out of service" in records[0].getMessage() and "back in service" in records[-1].getMessage()
        put = until(lambda: late.put_many([(key(3), chunk(3))]), lambda r: r[0].ok, 20)
        assert put[0].ok  # and serves once the store is up
        (got,), (dst,) = get(late, [key(3)])
        assert got.ok and np.array_equal(dst, chunk(3))

    def test_a_hung_store_costs_a_call_about_its_timeout(self, store):
        t = store.tier(timeout_s=store.hang_timeout_s, retry_s=0.1)
        assert until(lambda: t.put_many([(key(1), chunk(1))]), lambda r: r[0].ok, 10)[0].ok
        bound = 2 * store.hang_timeout_s + 1
        store.hang()
        try:
            results, took = timed(lambda: get(t, SPREAD)[0])  # not held: the store must say
            assert set(statuses(results)) == {IOStatus.TIMED_OUT}, results
            assert took < bound and t.down, took
            time.sleep(0.12)
            (put,), took = timed(lambda: t.put_many([(key(3), chunk(3))]))
            assert put.status in FAILED and took < bound, (put, took)
            time.sleep(0.12)
            held, took = timed(lambda: t.exists([key(1)]))
            assert held == [False] and took < bound
        finally:
            store.resume()
        results = until(lambda: get(t, [key(1)]), lambda r: r[0][0].ok, 15)
        assert results[0][0].ok and np.array_equal(results[1][0], chunk(1))

    def test_a_full_store_refuses_or_evicts_never_wrong_bytes(self, store):
        n = store.overflow
        with store.small() as small:
            t = small.tier()
            put = [r.status for at in range(0, n, 32)
                   for r in t.put_many([(key(i), chunk(i)) for i in range(at, min(at + 32, n))])]
            assert set(put) <= {IOStatus.OK, IOStatus.NO_SPACE} and not t.down, set(put)
            results, dsts = get(t, [key(i) for i in range(n)])
            hits = [i for i, r in enumerate(results) if r.ok]
            assert 0 < len(hits) < n and set(statuses(results)) <= {IOStatus.OK, IOStatus.MISSING}
            assert all(np.array_equal(dsts[i], chunk(i)) for i in hits) and not t.down
