"""A prefill/decode split through the pool (``handoff``): vLLM's ``kv_role`` read, a
producer's hand-off in ``kv_transfer_params``, hostile hand-offs refused, and a consumer
that stores nothing and waits, bounded, for a handed-off prompt to show in a shared
directory before loading it, or recomputes what never came."""

import dataclasses
import logging
import time
from collections import Counter

import pytest

from kvtier.config.settings import WritePolicy, load_config
from kvtier.connector.common.messages import StepPlan, WorkerReport
from kvtier.connector.scheduler.handoff import (
    ASK_EVERY_S,
    Handoff,
    Handoffs,
    Role,
    fit_role,
    has_pool,
)
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.keys import Namespace
from tests.helpers.handoff_requests import DIGEST, NS, request
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.remote_engine import Engine as RemoteEngine
from tests.helpers.scheduler_side import BLOCK, CHUNK, GEO, store_all, write_as
from tests.helpers.scheduler_side import request as remote_request


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def side(tmp_path, role: Role, name: str, **extra) -> SchedulerSide:
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 4 * GEO.chunk_bytes, "load_policy": "always",
           "disk_paths": [str(tmp_path)], "disk_capacity": 8 * (4096 + GEO.chunk_bytes),
           "instance_id": name, "share_writers": 2, "share_refresh": "10s", **extra}
    return SchedulerSide(load_config(cfg, environ={}), GEO, [NS], 1, role=role)


def test_vllms_roles_are_read_and_any_other_is_refused_naming_the_three():
    assert Role.of(None) is Role.BOTH and Role.of("kv_producer") is Role.PRODUCER
    assert Role.of("kv_consumer") is Role.CONSUMER and Role.of("kv_both") is Role.BOTH
    with pytest.raises(ValueError, match="kv_producer, kv_consumer or kv_both"):
        Role.of("kv_prefill")


@pytest.mark.parametrize("params", [None, [], "x", {}, {"kvtier": None}, {"kvtier": []},
                                    {"kvtier": {"tokens": "9", "namespace": DIGEST}},
                                    {"kvtier": {"tokens": True, "namespace": DIGEST}},
                                    {"kvtier": {"tokens": -1, "namespace": DIGEST}},
                                    {"kvtier": {"tokens": 9, "namespace": 7}},
                                    {"kvtier": {"tokens": 9, "namespace": "a" * 129}},
                                    {"kvtier": {"tokens": 9}}])
def test_a_hand_off_that_does_not_read_as_one_is_none(params):
    assert Handoff.of(params) is None


def test_a_producer_hands_off_its_prompts_length_and_namespace_and_only_a_producer():
    req = request("r", 70)
    req.num_prompt_tokens = 70  # type: ignore[attr-defined]
    params = Handoffs(Role.PRODUCER, NS, 1.0, Counter()).params(req)
    assert params == {"kvtier": {"tokens": 70, "namespace": DIGEST}}
    assert Handoff.of(params) == Handoff(70, DIGEST)
    assert Handoffs(Role.CONSUMER, NS, 1.0, Counter()).params(req) is None
    assert Handoffs(Role.BOTH, NS, 1.0, Counter()).params(req) is None
    assert Handoffs(Role.CONSUMER, NS, 1.0, Counter()).stores is False


def test_a_consumer_waits_asking_again_then_recomputes_what_never_came_said_once(caplog):
    clock, counters, asked = Clock(), Counter(), []
    handoffs = Handoffs(Role.CONSUMER, NS, 2.0, counters, clock=clock)
    whole, req = (request(name, 65, Handoff(65, DIGEST).params()) for name in ("w", "r"))
    assert handoffs.match(whole, 64, 64, 64, 0, asked.append) == 64  # all there: no wait
    assert handoffs.match(req, 32, 32, 64, 0, asked.append) is None  # half: ask again
    clock.now += ASK_EVERY_S / 2
    assert handoffs.match(req, 32, 32, 64, 0, asked.append) is None
    assert asked == ["r"]  # not asked again sooner than ASK_EVERY_S
    clock.now += ASK_EVERY_S
    assert handoffs.match(req, 32, 32, 64, 0, asked.append) is None and asked == ["r", "r"]
    clock.now += 2.0
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert handoffs.match(req, 32, 32, 64, 0, asked.append) == 32
        other = request("q", 65, Handoff(65, DIGEST).params())
        assert handoffs.match(other, 0, 0, 64, 0, asked.append) is None
        clock.now += 3.0
        assert handoffs.match(other, 0, 0, 64, 0, asked.append) == 0
    assert counters["handoffs_incomplete"] == 2 and counters["handoff_tokens_recomputed"] == 96
    assert handoffs.match(req, 32, 32, 64, 0, asked.append) == 32  # asked again: no second wait
    handoffs.forget("r")
    assert handoffs.match(req, 32, 32, 64, 0, asked.append) is None  # a new request of that id
    assert len([r for r in caplog.records if "load_timeout" in r.getMessage()]) == 1


def test_the_wait_is_for_what_is_visible_not_for_what_a_cut_lets_load():
    """What the load policy or host memory's room cuts off is no reason to wait: the
    handed-off tokens are all in the pool."""
    counters = Counter()
    handoffs = Handoffs(Role.CONSUMER, NS, 2.0, counters, clock=Clock())
    first, second, third = (request(name, 65, Handoff(65, DIGEST).params()) for name in "rst")
    assert handoffs.match(first, 0, 64, 64, 0, print) == 0  # recompute is faster: at once
    assert handoffs.match(second, 32, 64, 64, 0, print) == 32  # host memory stages half
    assert handoffs.match(third, 32, 32, 64, 0, print) is None  # half in the pool: wait
    assert counters["handoffs_incomplete"] == 0


def test_a_request_whose_wait_was_met_is_not_held_back_again_when_preempted():
    """vLLM asks again for a preempted request (nothing computed any more). Its hand-off
    was met long ago: if the pool has lost chunks since (its host memory and the producer's
    segment turned over), they are recomputed at once, not waited for until load_timeout
    for writes nobody will make. Found by a review."""
    clock, counters = Clock(), Counter()
    handoffs = Handoffs(Role.CONSUMER, NS, 2.0, counters, clock=clock)
    req = request("r", 65, Handoff(65, DIGEST).params())
    assert handoffs.match(req, 32, 32, 64, 0, print) is None  # half there: it waits
    clock.now += 1.0
    assert handoffs.match(req, 64, 64, 64, 0, print) == 64  # all there: met, loaded
    clock.now += 5.0
    assert handoffs.match(req, 0, 0, 64, 0, print) == 0  # preempted, the pool lost it all
    assert counters["handoffs_waited"] == 1 and counters["handoffs_incomplete"] == 0
    handoffs.forget("r")
    assert handoffs.match(req, 0, 0, 64, 0, print) is None  # a new request of that id


def test_a_consumer_sharing_no_pool_waits_for_nothing():
    """(nothing can come: each handed-off request would wait its whole load_timeout)"""
    counters = Counter()
    handoffs = Handoffs(Role.CONSUMER, NS, 2.0, counters, pooled=False, clock=Clock())
    assert handoffs.match(request("r", 65, Handoff(65, DIGEST).params()), 0, 0, 64, 0, print) == 0
    assert not counters
    config = load_config({"chunk_tokens": 32, "host_capacity": "1MiB"}, environ={})
    assert not has_pool(config) and has_pool(dataclasses.replace(config, remote_url="redis://h:1"))


def test_tokens_recomputed_count_only_those_past_what_vllm_holds():
    """vLLM's own hits (block-aligned) may reach past the pool's whole chunks: the tokens
    recomputed for want of the hand-off are those past what vLLM holds."""
    clock, counters = Clock(), Counter()
    handoffs = Handoffs(Role.CONSUMER, NS, 2.0, counters, clock=clock)
    req = request("r", 65, Handoff(65, DIGEST).params())
    assert handoffs.match(req, 0, -16, 64, 48, print) is None  # vLLM holds 48, the pool 32
    clock.now += 3.0
    assert handoffs.match(req, 0, -16, 64, 48, print) == 0
    assert counters["handoff_tokens_recomputed"] == 16  # 64 - 48 (before: 32)


def test_a_hand_off_of_another_namespace_or_none_is_not_waited_for():
    counters = Counter()
    handoffs = Handoffs(Role.CONSUMER, NS, 2.0, counters, clock=Clock())
    other = Namespace(model="other", kv_dtype="bfloat16", layout="l", block_tokens=16,
                      chunk_tokens=32).digest().hex()
    assert handoffs.match(request("r", 65, Handoff(65, other).params()), 0, 0, 64, 0, print) == 0
    assert handoffs.match(request("s", 65), 0, 0, 64, 0, print) == 0
    assert handoffs.match(request("t", 65, Handoff(65, DIGEST).params()), None, None, 64, 0, print) is None


def test_a_producer_hands_off_only_the_tokens_it_offered_to_the_pool(tmp_path):
    producer = side(tmp_path, Role.PRODUCER, "p")  # 4 host slots: 4 stores in flight at most
    try:
        for seed, chunks, offered in [(1, 2, 2), (2, 10, 2)]:  # the long one: 2 slots left
            req = request(f"r{seed}", chunks * CHUNK, seed=seed)
            req.num_prompt_tokens = chunks * CHUNK  # type: ignore[attr-defined]
            producer.plan_stores(req, (list(range(1, 1 + chunks * CHUNK // BLOCK)),),
                                 chunks * CHUNK, StepPlan())
            assert producer.handoff_params(req) == Handoff(offered * CHUNK, DIGEST).params()
        never = request("never", 64)
        never.num_prompt_tokens = 64  # type: ignore[attr-defined]
        assert producer.handoff_params(never) == Handoff(0, DIGEST).params()  # stored nothing
    finally:
        producer.close()


def test_a_producer_hands_off_no_chunk_the_pool_will_not_get(tmp_path):
    """A chunk found cached in host memory only (its disk write failed three times: given
    up) is not in the pool, and no write is on its way there: the hand-off ends before it,
    so a consumer computes it at once instead of waiting load_timeout for it."""
    producer = side(tmp_path, Role.PRODUCER, "p")
    try:
        x = request("x", 64, seed=3)
        store_all(producer, x, disk_ok=False)  # in host memory, not on disk
        for _ in range(2):  # written again, and failed again
            again = producer.build_meta().rewrites
            assert len(again) == 2
            producer.worker_report(WorkerReport(disk_failed=Counter({w.key: 1 for w in again})))
        assert producer.build_meta().rewrites == []
        store_all(producer, request("w", 64, seed=4))  # on disk: in the pool
        for name, seed, handed in [("y", 3, 0), ("v", 4, 64)]:
            req = request(name, 64, seed=seed)
            req.num_prompt_tokens = 64  # type: ignore[attr-defined]
            producer.plan_stores(req, (list(range(1, 1 + 64 // BLOCK)),), 64, StepPlan())
            assert producer.handoff_params(req) == Handoff(handed, DIGEST).params()
    finally:
        producer.close()


@pytest.mark.parametrize("cut", ["host memory's room", "load policy"])
def test_a_consumer_does_not_wait_for_chunks_the_pool_holds_but_it_would_not_load(tmp_path, cut):
    """Every handed-off chunk is visible: a load cut by host memory's room (4 slots for 6
    chunks) or by the load policy (recompute measured faster) is answered at once, not
    after load_timeout."""
    disk = {"disk_capacity": 32 * (4096 + GEO.chunk_bytes)}
    a = side(tmp_path, Role.PRODUCER, "a", host_capacity=8 * GEO.chunk_bytes, **disk)
    b = side(tmp_path, Role.CONSUMER, "b", load_timeout="30s", **disk,
             **({"load_policy": "auto"} if cut == "load policy" else {}))
    try:
        write_as(tmp_path, "a", store_all(a, request("x", 6 * CHUNK, seed=5)).stores)
        handed = request("y", 6 * CHUNK + 1, Handoff(6 * CHUNK + 1, DIGEST).params(), seed=5)
        last = b.chunk_keys(handed, 6)[-1]
        deadline = time.monotonic() + 5
        while b.others.find(last) is None:  # b's follower reads a's segment
            assert time.monotonic() < deadline, "b never saw a's chunks"
            b.others.refresh_soon()
            time.sleep(ASK_EVERY_S)
        if cut == "load policy":
            b.decider.prefill_seconds_per_token.value = 1e-12  # measured: prefill is fast
            b.decider.disk_seconds_per_byte.value = b.decider.host_seconds_per_byte.value = 1.0
        found, _ = b.num_new_matched_tokens(handed, 0)
        assert found == (4 * CHUNK if cut == "host memory's room" else 0)
        assert b.counters["handoffs_incomplete"] == 0
    finally:
        a.close()
        b.close()


def test_a_consumer_stores_nothing(tmp_path):
    b = side(tmp_path, Role.CONSUMER, "b")
    try:
        b.track(request("r", 64))
        assert not b.completes_chunks("r", 64)
    finally:
        b.close()


def test_a_consumer_waits_for_the_producers_chunks_to_show_in_the_shared_directory(tmp_path):
    a = side(tmp_path, Role.PRODUCER, "a")
    b = side(tmp_path, Role.CONSUMER, "b")
    try:
        stores = store_all(a, request("x", 64)).stores  # in a's host memory, not yet on disk
        handed = request("y", 65, Handoff(65, DIGEST).params())
        assert b.num_new_matched_tokens(handed, 0) == (None, False)  # not visible: ask again
        assert b.num_new_matched_tokens(request("z", 65), 0) == (0, False)  # no hand-off
        write_as(tmp_path, "a", stores)  # a's writes land; b refreshes soon, not in 10 s
        deadline = time.monotonic() + 5
        answer = b.num_new_matched_tokens(handed, 0)
        while answer[0] is None and time.monotonic() < deadline:
            time.sleep(ASK_EVERY_S)
            answer = b.num_new_matched_tokens(handed, 0)
        assert answer == (64, True)
        assert b.counters["handoffs_waited"] == 1 and b.counters["handoffs_incomplete"] == 0
    finally:
        a.close()
        b.close()


def test_a_prompt_of_whole_chunks_waits_for_its_last_chunk_too(tmp_path):
    """A 64-token prompt: its second chunk serves tokens 32-62 (all but the last token), so
    the consumer waits for it rather than taking the first alone."""
    a = side(tmp_path, Role.PRODUCER, "a")
    b = side(tmp_path, Role.CONSUMER, "b")
    try:
        stores = store_all(a, request("x", 64)).stores
        write_as(tmp_path, "a", stores[:1])  # the first chunk lands, the last not yet
        handed = request("y", 64, Handoff(64, DIGEST).params())
        handed.num_prompt_tokens = 64  # type: ignore[attr-defined]
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # the first chunk visible: still waiting
            assert b.num_new_matched_tokens(handed, 0)[0] is None
            time.sleep(ASK_EVERY_S)
        write_as(tmp_path, "a", stores)
        deadline = time.monotonic() + 5
        answer = b.num_new_matched_tokens(handed, 0)
        while answer[0] is None and time.monotonic() < deadline:
            time.sleep(ASK_EVERY_S)
            answer = b.num_new_matched_tokens(handed, 0)
        assert answer == (63, True) and b.counters["handoffs_incomplete"] == 0
    finally:
        a.close()
        b.close()


def test_a_consumers_sampled_hit_is_checked_and_nothing_stored(tmp_path):
    a = side(tmp_path, Role.PRODUCER, "a")
    b = side(tmp_path, Role.CONSUMER, "b", verify_sample=1)
    try:
        write_as(tmp_path, "a", store_all(a, request("x", 64)).stores)
        b.others.refresh_soon()
        deadline = time.monotonic() + 5
        while b.others.counts().chunks < 2:
            assert time.monotonic() < deadline
            time.sleep(ASK_EVERY_S)
        req = request("y", 65)
        assert b.num_new_matched_tokens(req, 0) == (0, False)  # sampled: computed
        assert b.completes_chunks("y", 65)
        meta = StepPlan()
        b.plan_stores(req, ([1, 2, 3, 4, 5],), 65, meta)
        assert [v.tier for v in meta.verifies] == ["shared", "shared"] and not meta.stores
        plain = request("z", 65, seed=7)
        b.track(plain)
        assert not b.completes_chunks("z", 65)  # not sampled: a consumer stores nothing
    finally:
        a.close()
        b.close()


def test_a_producer_that_never_writes_costs_the_consumer_load_timeout_then_a_recompute(tmp_path):
    b = side(tmp_path, Role.CONSUMER, "b", load_timeout="300ms")
    try:
        handed = request("y", 65, Handoff(65, DIGEST).params())
        started = time.monotonic()
        answer = b.num_new_matched_tokens(handed, 0)
        while answer[0] is None and time.monotonic() - started < 10:
            time.sleep(ASK_EVERY_S)
            answer = b.num_new_matched_tokens(handed, 0)
        assert answer == (0, False) and b.counters["handoffs_incomplete"] == 1
    finally:
        b.close()


@pytest.mark.parametrize(("role", "extra", "warned"), [
    (Role.PRODUCER, {}, True), (Role.CONSUMER, {"disk_paths": ["/x"]}, True),
    (Role.PRODUCER, {"disk_paths": ["/x"], "share_writers": 2, "share_refresh": "off"}, True),
    (Role.PRODUCER, {"disk_paths": ["/x"], "share_writers": 2}, False),
    (Role.CONSUMER, {"remote_url": "redis://127.0.0.1:1/0"}, False), (Role.BOTH, {}, False)])
def test_a_producer_or_consumer_without_a_shared_pool_is_told_so_once(caplog, role, extra, warned):
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        fit_role(role, load_config(extra, environ={}))
    assert any("no pool shared" in r.getMessage() for r in caplog.records) is warned


def test_a_producer_writes_every_chunk_to_the_pool_at_once_whatever_was_set(caplog):
    cfg = load_config({"write_policy": "write_back", "remote_min_hits": 3,
                       "remote_url": "redis://127.0.0.1:1/0"}, environ={})
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        fitted = fit_role(Role.PRODUCER, cfg)
    assert fitted.write_policy is WritePolicy.WRITE_THROUGH and fitted.remote_min_hits == 0
    assert any("write_through and remote_min_hits 0" in r.getMessage() for r in caplog.records)
    assert fit_role(Role.CONSUMER, cfg) == cfg and fit_role(Role.BOTH, cfg) == cfg


@needs_redis
def test_a_consumer_waits_for_the_producers_chunks_to_reach_the_remote_store(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    a = RemoteEngine(server, role=Role.PRODUCER)
    b = RemoteEngine(server, role=Role.CONSUMER)
    try:
        prompt = remote_request("x", 4 * CHUNK + 1, seed=3)
        handed = remote_request("y", 4 * CHUNK + 1, seed=3)
        handed.kv_transfer_params = Handoff(4 * CHUNK + 1, b.ns.digest().hex()).params()
        assert b.match(handed, timeout=0.5) == (None, False)  # not in the store yet: ask again
        a.store(prompt, list(range(1, 9)))
        assert a.scheduler.counters["remote_written_chunks"] == 4
        assert b.match(handed) == (4 * CHUNK, True)  # the question asked again, answered
        assert b.scheduler.counters["handoffs_waited"] == 1
    finally:
        a.close()
        b.close()
        server.stop()


def test_a_producer_hands_off_the_chunks_it_loaded_from_another_engines_segment(tmp_path):
    """A prefix this producer loaded from another engine's segment of the shared directory is
    in the pool: the consumer reads it there, so the hand-off names it and what follows."""
    a, b = side(tmp_path, Role.PRODUCER, "a"), side(tmp_path, Role.PRODUCER, "b")
    try:
        write_as(tmp_path, "a", store_all(a, request("x", 2 * CHUNK, seed=5)).stores)
        y = request("y", 4 * CHUNK, seed=5)  # the same first two chunks as x
        y.num_prompt_tokens = 4 * CHUNK
        last, deadline = b.chunk_keys(y, 2)[-1], time.monotonic() + 5
        while b.others.find(last) is None:
            assert time.monotonic() < deadline
            b.others.refresh_soon()
            time.sleep(ASK_EVERY_S)
        found, _ = b.num_new_matched_tokens(y, 0)
        blocks = (list(range(1, 1 + 4 * CHUNK // BLOCK)),)
        b.plan_load(y, blocks, 0, found)
        assert found == 2 * CHUNK and len(b.build_meta().loads) == 1
        b.worker_report(WorkerReport(loads_done=Counter({"y": 1})))
        meta = StepPlan()
        b.plan_stores(y, blocks, 4 * CHUNK, meta)
        assert len(meta.stores) == 2  # the chunks it computed, with disk slots
        assert b.handoff_params(y) == Handoff(4 * CHUNK, DIGEST).params()
    finally:
        a.close()
        b.close()


def test_params_any_client_can_send_hold_no_producer_and_at_most_so_many_requests(monkeypatch):
    """A producer computes its prompts (it waits for no one's), and past ``MAX_WAITING``
    requests waiting at once the others load what the pool holds now."""
    from kvtier.connector.scheduler import handoff as handoff_module

    params = Handoff(65, DIGEST).params()
    producer = Handoffs(Role.PRODUCER, NS, 2.0, Counter(), clock=Clock())
    assert producer.match(request("p", 65, params), 0, 0, 64, 0, lambda r: None) == 0
    monkeypatch.setattr(handoff_module, "MAX_WAITING", 2)
    both = Handoffs(Role.BOTH, NS, 2.0, Counter(), clock=Clock())
    waits = [both.match(request(n, 65, params), 0, 0, 64, 0, lambda r: None) for n in "abc"]
    assert waits == [None, None, 0]
    assert both.match(request("a", 65, params), 0, 0, 64, 0, lambda r: None) is None  # still
