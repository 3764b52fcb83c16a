"""The connector's remote tier without vLLM: scheduler sides that ask the store in the
background (never on the step), plan remote writes of stored chunks and remote loads of
chunks another engine wrote; workers that move the bytes, verified. Two engines with
separate host memory and no shared directory share chunks through one redis-server."""

import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from kvtier.config.settings import load_config
from kvtier.connector.common.messages import ChunkStore, StepPlan, WorkerReport
from kvtier.connector.scheduler.remote_audit import remote_writes
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.remote.values import value_key
from kvtier.tiers.base import TierName
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.remote_engine import Engine
from tests.helpers.scheduler_side import CHUNK, GEO, request
from tests.helpers.worker_side import HIDDEN as WORKER_HIDDEN

pytestmark = needs_redis
REMOTE = TierName.REMOTE


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def test_b_loads_what_a_stored_through_the_store_with_the_same_bytes(server):
    assert WORKER_HIDDEN  # the worker tests' geometry: the same paged cache shape
    a, b = Engine(server), Engine(server)
    try:
        req = request("r", 4 * CHUNK + 1, seed=3)  # 4 chunks, then one token computed
        a.store(req, list(range(1, 9)))
        assert a.scheduler.counters["remote_written_chunks"] == 4
        assert len(list(server.client().scan_iter(match="kvtier:*"))) == 4
        # b asks the store in the background: "ask again" first, never a wait on the step
        assert b.scheduler.num_new_matched_tokens(req, 0) in ((None, False), (4 * CHUNK, True))
        assert b.match(req) == (4 * CHUNK, True)
        targets = list(range(8, 16))
        b.scheduler.plan_load(req, (targets,), 0, 4 * CHUNK)
        assert b.scheduler.load_tiers("r", 4 * CHUNK) == {TierName.DISK: 0, TierName.HOST: 0,
                                                          REMOTE: 4 * CHUNK}
        b.step()
        assert b.worker.take_invalid_blocks() == set()
        assert all(torch.equal(x, y) for x, y in zip(b.pages(targets), a.pages(list(range(1, 9))),
                                                   strict=True))
        b.step()
        assert b.scheduler.counters["load_chunks_remote"] == 4
        assert b.scheduler.counters["remote_written_chunks"] == 0  # read from it: not written back
        # now in b's host memory: a second request hits there, no store needed
        b.scheduler.request_finished("r")
        again = request("r2", 4 * CHUNK + 1, seed=3)
        assert b.scheduler.num_new_matched_tokens(again, 0) == (4 * CHUNK, False)
    finally:
        a.close()
        b.close()


def test_a_damaged_value_is_recomputed_never_loaded(server):
    a, b = Engine(server), Engine(server)
    try:
        req = request("r", 2 * CHUNK + 1, seed=4)
        a.store(req, list(range(1, 5)))
        raw = server.client()
        names = sorted(raw.scan_iter(match="kvtier:*"))
        for name in names:
            value = bytearray(raw.get(name))
            value[-7] ^= 0x5A
            raw.set(name, bytes(value))
        assert b.match(req) == (2 * CHUNK, True)
        b.scheduler.plan_load(req, ([9, 10, 11, 12],), 0, 2 * CHUNK)
        before = b.pages([9, 10, 11, 12])
        b.step()
        assert b.worker.take_invalid_blocks() == {9, 10, 11, 12}
        assert b.scheduler.counters["load_failed_chunks"] == 2
        assert b.worker.stats().data["remote_failures"] == 2
        assert all(torch.equal(x, y) for x, y in zip(b.pages([9, 10, 11, 12]), before, strict=True))
    finally:
        a.close()
        b.close()


def test_the_store_down_is_a_miss_at_once_and_stores_go_on(server):
    a = Engine(server)
    try:
        server.stop()
        req = request("r", 2 * CHUNK + 1, seed=5)
        assert a.match(req) == (0, False)
        assert a.scheduler.num_new_matched_tokens(request("q", 2 * CHUNK + 1, seed=6), 0) == (0, False)
        a.store(req, list(range(1, 5)))
        assert a.scheduler.counters["stored_chunks"] == 2
        assert a.scheduler.num_new_matched_tokens(request("r3", 2 * CHUNK + 1, seed=5), 0) \
            == (2 * CHUNK, False)  # from host memory
        # nothing pinned for ever by writes that could not go: the host slots are all usable
        assert a.scheduler.stack.indexes[TierName.HOST].reusable_slots == 8
    finally:
        a.close()


def test_with_min_hits_a_chunk_goes_to_the_store_once_it_was_loaded_that_often(server):
    a = Engine(server, remote_min_hits=2)
    try:
        req = request("r", 2 * CHUNK + 1, seed=7)
        a.store(req, list(range(1, 5)))
        assert a.scheduler.counters["remote_written_chunks"] == 0
        for n in range(2):
            again = request(f"again{n}", 2 * CHUNK + 1, seed=7)
            assert a.match(again) == (2 * CHUNK, False)
            a.scheduler.plan_load(again, ([9, 10, 11, 12],), 0, 2 * CHUNK)
            a.step()
            a.step()
            a.step()
            a.scheduler.request_finished(again.request_id)
        assert a.scheduler.counters["remote_written_chunks"] == 2
        key = value_key("kvtier:", GEO.namespace("m", "", 1, 0).digest(),
                        a.scheduler.chunk_keys(req, 1)[0])
        assert server.client().exists(key)
    finally:
        a.close()


def test_metrics_count_remote_loads_and_writes(server):
    a = Engine(server)
    try:
        a.store(request("r", 2 * CHUNK + 1, seed=8), list(range(1, 5)))
        samples = {s.name: s for s in a.scheduler.metric_samples()}
        assert samples["remote_written_total"].values[()] == 2
        assert samples["remote_up"].values[()] == 1
        assert samples["remote_nodes_out"].values[()] == 0
        assert samples["remote_records_passed_over_total"].values[()] == 0
        assert (("tier", "remote"),) in samples["chunks_loaded_total"].values
        a.scheduler.presence.tiers[0].records_passed_over = 3  # white-box: as the log's reader counts
        samples = {s.name: s for s in a.scheduler.metric_samples()}
        assert samples["remote_records_passed_over_total"].values[()] == 3
        worker = {s.name: s for s in a.worker.metric_samples()}
        assert worker["worker_remote_writes_total"].values[()] == 2
    finally:
        a.close()


def test_remote_outcomes_count_over_ranks():
    report = WorkerReport(remote_written=Counter({b"k": 1})).merged(
        WorkerReport(remote_failed=Counter({b"k": 1})))
    assert report.remote_written[b"k"] == 1 and report.remote_failed[b"k"] == 1
    assert not report.is_empty()


def test_remote_writes_in_flight_hold_at_most_256_mib_of_host_memory():
    """Half the host slots and 256 MiB at most, as in a KVStore: with chunks of 32 MiB and
    2,048 host slots (a 64 GiB host tier) a slow store held 1,024 of them. Found by a
    review."""
    chunk, slots = 32 * 2**20, 2048
    host = SimpleNamespace(num_slots=slots, pin=lambda key: None)
    stack = SimpleNamespace(indexes={TierName.HOST: host})
    presence = SimpleNamespace(down=False, take_absent=list)
    counters = Counter()
    writes, _ = remote_writes(presence, stack, counters, 1, load_config({}, environ={}), chunk)
    taken = sum(writes.with_store(ChunkKey(i.to_bytes(16, "big"))) for i in range(slots))
    assert taken == 8 and counters["remote_dropped_chunks"] == slots - 8


def test_with_two_ranks_a_chunk_counts_only_when_both_copies_are_in_the_store(server):
    import numpy as np

    from kvtier.remote.redis_tier import RedisTier

    cfg = load_config({"chunk_tokens": CHUNK, "host_capacity": 8 * GEO.chunk_bytes,
                       "load_policy": "always", "remote_url": server.url}, environ={})
    namespaces = [GEO.namespace("m", "", 2, r) for r in range(2)]
    side = SchedulerSide(cfg, GEO, namespaces, 2)
    try:
        req = request("r", 2 * CHUNK + 1, seed=9)
        keys = side.chunk_keys(req, 2)
        payload = np.zeros(GEO.chunk_bytes, np.uint8)
        ranks = [RedisTier(server.url, ns, GEO.chunk_bytes) for ns in namespaces]
        ranks[0].put_many([(k, payload) for k in keys])  # rank 0's copies only
        ranks[1].put_many([(keys[0], payload)])  # and rank 1's of the first chunk
        deadline = time.monotonic() + 10
        while (answer := side.num_new_matched_tokens(req, 0))[0] is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert answer == (CHUNK, True)
        for tier in ranks:
            tier.close()
    finally:
        side.close()


def test_a_worker_closing_at_once_still_writes_every_chunk_queued(server):
    a = Engine(server)
    try:
        req = request("r", 4 * CHUNK + 1, seed=10)  # 4 writes: as many as 8 host slots allow
        meta = StepPlan()
        a.scheduler.plan_stores(req, (list(range(1, 9)),), req.num_tokens, meta)
        assert sum(s.remote for s in meta.stores) == 4
        a.worker.save(a.scheduler.build_meta(meta))  # two writes run, two wait for a job
        assert a.worker.close()
        assert len(list(server.client().scan_iter(match="kvtier:*"))) == 4
    finally:
        a.scheduler.close()


def two_ranks(server, seed: int, **extra) -> tuple[SchedulerSide, ChunkStore]:
    """A scheduler side of a TP-2 engine and the one chunk store it planned."""
    cfg = load_config({"chunk_tokens": CHUNK, "host_capacity": 8 * GEO.chunk_bytes,
                       "load_policy": "always", "remote_url": server.url, **extra}, environ={})
    side = SchedulerSide(cfg, GEO, [GEO.namespace("m", "", 2, r) for r in range(2)], 2)
    req = request("r", CHUNK + 1, seed=seed)
    meta = StepPlan()
    side.plan_stores(req, ([1, 2],), req.num_tokens, meta)
    (store,) = meta.stores
    return side, store


def test_a_store_one_rank_failed_keeps_its_host_slot_while_another_rank_still_writes_it(server):
    side, store = two_ranks(server, seed=11)
    try:
        assert store.remote
        host = side.stack.indexes[TierName.HOST]
        # rank 0 stored it and is still sending it; rank 1 failed its copy
        side.worker_report(WorkerReport(host_stored=Counter({store.key: 1}),
                                        host_failed=Counter({store.key: 1}),
                                        remote_failed=Counter({store.key: 1})))
        assert host.reusable_slots == 7  # the slot stays taken: rank 0 reads it
        side.worker_report(WorkerReport(remote_written=Counter({store.key: 1})))
        assert host.reusable_slots == 8 and side.stack.locate(store.key) is None
        assert side.counters["remote_failed_chunks"] == 1
    finally:
        side.close()


def test_a_store_one_rank_failed_is_freed_once_both_its_disk_and_remote_writes_are_over(server, tmp_path):
    side, store = two_ranks(server, seed=12, disk_paths=[str(tmp_path)],
                            disk_capacity=8 * (4096 + GEO.chunk_bytes))
    try:
        assert store.remote and store.disk_slot is not None
        host = side.stack.indexes[TierName.HOST]
        # rank 0 stored it, still writing it to disk and the store; rank 1 failed its copy
        side.worker_report(WorkerReport(host_stored=Counter({store.key: 1}),
                                        host_failed=Counter({store.key: 1}),
                                        disk_failed=Counter({store.key: 1}),
                                        remote_failed=Counter({store.key: 1})))
        assert host.reusable_slots == 7
        side.worker_report(WorkerReport(remote_written=Counter({store.key: 1})))
        assert host.reusable_slots == 7  # its disk write still reads the slot
        side.worker_report(WorkerReport(disk_written=Counter({store.key: 1})))
        assert host.reusable_slots == 8 and side.stack.locate(store.key) is None
    finally:
        side.close()


def damage(server, fault: str, names=None) -> None:
    """Every kvtier value in the store (or ``names``) evicted, or damaged in place."""
    raw = server.client()
    for name in names if names is not None else list(raw.scan_iter(match="kvtier:*")):
        if fault == "evicted":
            raw.delete(name)
        else:
            value = bytearray(raw.get(name))
            value[-7] ^= 0x5A
            raw.set(name, bytes(value))


@pytest.mark.parametrize("fault", ["evicted", "corrupt"])
def test_a_remote_chunk_whose_read_failed_is_not_offered_to_its_request_again(server, fault):
    """vLLM's sequence after a failed asynchronous load (recompute policy): the request is
    rewound to its first invalid block (here 0) and asked about again, with the same id. The
    store still answers "held" for a damaged value, and the request's answer was kept."""
    a, b = Engine(server), Engine(server)
    try:
        req = request("r", 2 * CHUNK + 1, seed=13)
        a.store(req, list(range(1, 5)))
        assert b.match(req) == (2 * CHUNK, True)  # the store answered: both chunks held
        damage(server, fault)  # evicted or damaged between the lookup and the read
        b.scheduler.plan_load(req, ([9, 10, 11, 12],), 0, 2 * CHUNK)
        b.step()
        assert b.worker.take_invalid_blocks() == {9, 10, 11, 12}
        assert b.scheduler.counters["load_failed_chunks"] == 2
        # a value gone since the lookup is a miss, not a failure of the store
        assert b.worker.stats().data.get("remote_failures", 0) == (fault == "corrupt") * 2
        assert b.match(req) == (0, False)  # recomputed, not loaded again (and again)
        # a new request for the same prefix is not trapped by a damaged value either
        assert b.match(request("r2", 2 * CHUNK + 1, seed=13)) == (0, False)
        assert b.scheduler.counters["load_failed_chunks"] == 2
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("fault", ["corrupt", "timed out"])
def test_a_chunk_whose_remote_value_was_damaged_is_written_again_when_recomputed(
        server, monkeypatch, fault):
    """An engine that wrote a chunk to the store remembers it is there and does not write it
    again; once its read from there found the value damaged, its recompute writes it over
    it. A read that failed otherwise (a timeout, a redirect) is no news of the value: the
    recompute writes nothing (it wrote it again; found by a review), and other requests
    leave it out only until the store is tried again (60 s before: a review)."""
    a, b, c = Engine(server), Engine(server), Engine(server)
    try:
        req = request("r", CHUNK + 1, seed=16)
        b.store(req, [1, 2])  # b's chunk, in its host memory and in the store
        (key,) = b.scheduler.chunk_keys(req, 1)
        for i in range(8):  # b's host memory fills with others: the chunk is evicted there
            b.store(request(f"o{i}", CHUNK + 1, seed=20 + i), [3, 4])
        if fault == "corrupt":
            damage(server, "corrupt", [value_key("kvtier:", b.ns.digest(), key)])
        else:
            tier = b.worker._remote._lane.tier
            timed_out = [IOResult(IOStatus.TIMED_OUT, 0, "no answer")]
            monkeypatch.setattr(tier, "get_many", lambda keys, dsts: timed_out * len(keys))
            monkeypatch.setattr(tier, "get_parts", lambda keys, dsts, w: timed_out * len(keys))
        assert b.match(req) == (CHUNK, True)
        b.scheduler.plan_load(req, ([9, 10],), 0, CHUNK)
        b.step()
        assert b.worker.take_invalid_blocks() == {9, 10}
        # left out of other requests' loads: a damaged value for DISTRUST_S, a read that
        # failed on its way only until the workers try the store again (remote_retry)
        left = b.scheduler.presence._distrusted._until[key] - time.monotonic()  # white-box
        assert 50 < left <= 60 if fault == "corrupt" else 0 < left <= 10
        b.scheduler.request_finished("r")
        written = b.scheduler.counters["remote_written_chunks"]
        b.store(request("r", CHUNK + 1, seed=16), [9, 10])  # recomputed, stored again
        again = 1 if fault == "corrupt" else 0
        assert b.scheduler.counters["remote_written_chunks"] == written + again
        assert c.match(req) == (CHUNK, True)  # another engine loads it, whole
        c.scheduler.plan_load(req, ([5, 6],), 0, CHUNK)
        c.step()
        assert c.worker.take_invalid_blocks() == set()
    finally:
        for engine in (a, b, c):
            engine.close()


def test_only_the_remote_chunk_that_failed_is_refused(server):
    a, b = Engine(server), Engine(server)
    try:
        req = request("r", 3 * CHUNK + 1, seed=14)
        a.store(req, list(range(1, 7)))
        keys = b.scheduler.chunk_keys(req, 3)
        assert b.match(req) == (3 * CHUNK, True)
        damage(server, "corrupt", [value_key("kvtier:", b.ns.digest(), keys[1])])
        b.scheduler.plan_load(req, ([9, 10, 11, 12, 13, 14],), 0, 3 * CHUNK)
        b.step()
        assert b.worker.take_invalid_blocks() == {11, 12, 13, 14}  # the second chunk on
        assert b.scheduler.counters["load_failed_chunks"] == 1
        # the first chunk arrived (now in host memory); the second is refused, so the third,
        # still good in the store, is past the hit
        assert b.match(req) == (CHUNK, False)
    finally:
        a.close()
        b.close()


def test_a_chunk_cached_here_past_one_only_the_store_holds_loads_from_here(server):
    """Found by scripts/bench_router.py --remote: a request whose first chunk only the
    store held, and whose second this engine held in host memory, asked again for ever
    (the second looked as if another load were staging it)."""
    a, b = Engine(server), Engine(server)
    try:
        req = request("r", 2 * CHUNK + 1, seed=5)
        a.store(req, [1, 2, 3, 4])
        b.store(req, [1, 2, 3, 4])
        first = b.scheduler.chunk_keys(req, 1)[0]
        b.scheduler.stack.discard(first)  # evicted here: only the store holds it now
        b.scheduler.request_finished("r")
        again = request("r2", 2 * CHUNK + 1, seed=5)
        assert b.match(again) == (2 * CHUNK, True)
        b.scheduler.plan_load(again, ([5, 6, 7, 8],), 0, 2 * CHUNK)
        assert b.scheduler.load_tiers("r2", 2 * CHUNK) == {TierName.DISK: 0,
                                                           TierName.HOST: CHUNK, REMOTE: CHUNK}
        b.step()
        b.step()
        assert b.worker.take_invalid_blocks() == set()
        assert b.scheduler.counters["load_chunks_remote"] == 1
        assert b.scheduler.counters["load_chunks_host"] == 1
        # the store's copy: b wrote it last (it did not know a had), over a's
        assert all(torch.equal(x, y) for x, y in zip(b.pages([5, 6]), b.pages([1, 2]),
                                                   strict=True))
        assert all(torch.equal(x, y) for x, y in zip(b.pages([7, 8]), b.pages([3, 4]),
                                                   strict=True))  # from b's host memory
    finally:
        a.close()
        b.close()


def test_a_chunk_cached_only_here_past_one_only_the_store_holds_carries_the_hit_on(server):
    """The prefix walk past what is cached here takes each chunk from here or the store,
    whichever holds it: before, a chunk the store lacked ended the hit even when cached."""
    a, b = Engine(server), Engine(server)
    try:
        req = request("r", 2 * CHUNK + 1, seed=6)
        a.store(req, [1, 2, 3, 4])
        b.store(req, [1, 2, 3, 4])
        first, second = b.scheduler.chunk_keys(req, 2)
        b.scheduler.stack.discard(first)  # evicted here: only the store holds it now
        damage(server, "evicted", [value_key("kvtier:", b.ns.digest(), second)])
        b.scheduler.request_finished("r")
        again = request("r2", 2 * CHUNK + 1, seed=6)
        assert b.match(again) == (2 * CHUNK, True)
        b.scheduler.plan_load(again, ([5, 6, 7, 8],), 0, 2 * CHUNK)
        b.step()
        b.step()
        assert b.worker.take_invalid_blocks() == set()
        assert b.scheduler.counters["load_chunks_remote"] == 1
        assert b.scheduler.counters["load_chunks_host"] == 1
        assert all(torch.equal(x, y) for x, y in zip(b.pages([5, 6, 7, 8]), b.pages([1, 2, 3, 4]),
                                                   strict=True))
    finally:
        a.close()
        b.close()


def test_a_chunk_whose_write_the_store_missed_is_written_when_found_cached_at_a_store(server):
    """Stored while the store was down (no write out), then computed again (vLLM's own hit,
    say) with the store back: found cached, its write goes now, as a producer's hand-off of
    it needs."""
    a = Engine(server)
    try:
        server.stop()
        req = request("r", 2 * CHUNK + 1, seed=7)
        a.store(req, list(range(1, 5)))
        assert a.scheduler.counters["stored_chunks"] == 2
        assert a.scheduler.counters["remote_written_chunks"] == 0
        server.start()
        time.sleep(0.5)  # past remote_retry (300 ms): the store is asked again
        a.scheduler.request_finished("r")
        a.store(request("r2", 2 * CHUNK + 1, seed=7), list(range(5, 9)))  # found cached
        assert a.scheduler.counters["remote_written_chunks"] == 2
        assert len(list(server.client().scan_iter(match="kvtier:*"))) >= 2
    finally:
        a.close()


def test_the_nodes_out_are_those_any_ranks_copy_of_the_tier_found():
    """Each rank's copy of a cluster's tier knows the nodes it found out of service: the
    scheduler side counts each node once, whichever copies found it."""
    from kvtier.connector.scheduler.remote_presence import RemotePresence

    found = (["a:1", "b:1"], ["b:1"], [])
    copies = [SimpleNamespace(nodes_out=lambda out=out: out, close=lambda: None) for out in found]
    presence = RemotePresence(copies, wait_s=1)
    try:
        assert presence.nodes_out() == 2
        presence.tiers = copies[2:]
        assert presence.nodes_out() == 0
    finally:
        presence.close()
