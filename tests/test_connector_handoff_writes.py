"""A producer's writes to the pool after its hand-off: a handed-off chunk whose disk write
fails once vLLM has finished the request (its blocks freed, its hand-off given) is written
again from the producer's host copy, so the consumer loads it, byte for byte, instead of
waiting out load_timeout and recomputing it."""

import errno
import time
from collections import Counter
from types import SimpleNamespace

import torch

from kvtier.config.settings import load_config
from kvtier.connector.common.messages import StepPlan, WorkerReport
from kvtier.connector.scheduler.handoff import ASK_EVERY_S, Handoff, Role
from kvtier.connector.scheduler.remote_writes import RemoteWrites
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.worker.side import WorkerSide
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import Location
from tests.helpers.disk_helpers import failing_io
from tests.helpers.handoff_requests import DIGEST, NS, Request
from tests.helpers.handoff_requests import request as handoff_request
from tests.helpers.scheduler_side import BLOCK, CHUNK, GEO
from tests.helpers.worker_side import BLOCKS, same


def request(name: str, tokens: int, params=None, seed: int = 0) -> Request:
    return handoff_request(name, tokens, params, seed, prompt=tokens)


class Engine:
    """A scheduler side and one worker on a shared directory, stepped by hand."""

    def __init__(self, tmp_path, name: str, role: Role, **extra) -> None:
        cfg = load_config({"chunk_tokens": CHUNK, "host_capacity": 8 * GEO.chunk_bytes,
                           "load_policy": "always", "disk_paths": [str(tmp_path)],
                           "disk_capacity": 8 * (4096 + GEO.chunk_bytes), "disk_min_free": 0,
                           "instance_id": name, "share_writers": 2, "share_refresh": "10s",
                           "io_threads": 2, **extra}, environ={})
        self.scheduler = SchedulerSide(cfg, GEO, [NS], 1, role=role)
        self.worker = WorkerSide(cfg, GEO, NS)
        shape = (GEO.num_layers, BLOCKS, 2, BLOCK, GEO.page_bytes // (2 * BLOCK * 2))
        self.kv = list(torch.randn(*shape).to(torch.bfloat16).unbind(0))
        self.worker.register({f"layer{i}": t for i, t in enumerate(self.kv)})

    def run(self, meta: StepPlan | None = None) -> StepPlan:
        """A step's plan to the worker, its reads and writes started, nothing reported."""
        meta = self.scheduler.build_meta(meta)
        self.worker.start_loads(meta)
        self.worker.save(meta)
        return meta

    def report(self) -> None:
        """The worker's I/O waited for, its report to the scheduler side."""
        self.worker.drain(10)
        self.worker.finished()
        report = self.worker.report()
        if report is not None:
            self.scheduler.worker_report(report)

    def step(self, meta: StepPlan | None = None) -> None:
        self.run(meta)
        self.report()

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


def wait_for_hand_off(consumer: SchedulerSide, handed: Request) -> tuple[int | None, bool]:
    deadline = time.monotonic() + 10
    answer = consumer.num_new_matched_tokens(handed, 0)
    while answer[0] is None and time.monotonic() < deadline:
        time.sleep(ASK_EVERY_S)
        answer = consumer.num_new_matched_tokens(handed, 0)
    return answer


def test_a_disk_write_that_fails_after_the_hand_off_is_written_again_and_loaded(
        tmp_path, monkeypatch):
    producer = Engine(tmp_path, "p", Role.PRODUCER)
    consumer = Engine(tmp_path, "c", Role.CONSUMER, load_timeout="1s")
    try:
        prompt = request("x", 2 * CHUNK, seed=1)
        meta = StepPlan()
        producer.scheduler.plan_stores(prompt, ([1, 2, 3, 4],), 2 * CHUNK, meta)
        with failing_io(monkeypatch, "slots-", err=errno.EIO, calls=("pwritev",)):
            producer.run(meta)  # the prompt's last step: pages copied, disk writes started
            params = producer.scheduler.handoff_params(prompt)  # vLLM finishes the request
            assert params == Handoff(2 * CHUNK, DIGEST).params()  # (writes in flight)
            assert producer.scheduler.request_finished("x") is False  # its blocks are freed
            producer.report()  # the writes failed (an I/O error, once)
        assert producer.scheduler.counters["disk_failed_chunks"] == 2
        for _ in range(3):  # the producer's next steps
            producer.step()
        handed = request("y", 2 * CHUNK + 1, params, seed=1)
        assert wait_for_hand_off(consumer.scheduler, handed) == (2 * CHUNK, True)
        assert consumer.scheduler.counters["handoffs_incomplete"] == 0
        consumer.scheduler.plan_load(handed, ([5, 6, 7, 8],), 0, 2 * CHUNK)
        consumer.step()
        assert consumer.worker.take_invalid_blocks() == set()
        assert all(same(c[5:9], p[1:5]) for c, p in zip(consumer.kv, producer.kv, strict=True))
    finally:
        producer.close()
        consumer.close()


def producer_side(tmp_path, role: Role = Role.PRODUCER, paths: int = 1, **extra) -> SchedulerSide:
    roots = [tmp_path / f"p{i}" for i in range(paths)]
    for root in roots:
        root.mkdir(parents=True, exist_ok=True)
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 4 * GEO.chunk_bytes, "load_policy": "always",
           "disk_paths": [str(root) for root in roots], "instance_id": "p", "share_writers": 2,
           "disk_capacity": 8 * paths * (4096 + GEO.chunk_bytes), "share_refresh": "10s", **extra}
    return SchedulerSide(load_config(cfg, environ={}), GEO, [NS], 1, role=role)


def stored(side: SchedulerSide, name: str, tokens: int, seed: int = 0) -> tuple[Request, list]:
    """A prompt planned for store, every chunk stored in host memory, its disk writes out."""
    req = request(name, tokens, seed=seed)
    meta = StepPlan()
    side.plan_stores(req, (list(range(1, 1 + tokens // BLOCK)),), tokens, meta)
    side.worker_report(WorkerReport(host_stored=Counter({s.key: 1 for s in meta.stores})))
    return req, meta.stores


def test_a_producer_writes_a_failed_chunk_again_twice_at_most_then_keeps_it_in_host_memory(
        tmp_path):
    side = producer_side(tmp_path)
    try:
        req, (store,) = stored(side, "x", CHUNK)
        key, host = store.key, side.stack.indexes[TierName.HOST]
        for _ in range(2):
            side.worker_report(WorkerReport(disk_failed=Counter({key: 1})))
            assert host.pinned(key)  # its host copy, kept for the write again
            (again,) = side.build_meta().rewrites
            assert (again.key, again.host_slot) == (key, store.host_slot)
            assert side.handoff_params(req) == Handoff(CHUNK, DIGEST).params()  # on its way
        side.worker_report(WorkerReport(disk_failed=Counter({key: 1})))
        assert side.build_meta().rewrites == []
        assert key in host and not host.pinned(key)  # given up: in host memory only
        assert side.handoff_params(req) == Handoff(0, DIGEST).params()  # not coming
        counters = side.counters
        assert (counters["disk_failed_chunks"], counters["pool_rewritten_chunks"],
                counters["pool_given_up_chunks"]) == (3, 2, 1)
    finally:
        side.close()


def test_a_chunk_written_on_its_second_try_is_on_disk_and_its_host_slot_let_go(tmp_path):
    side = producer_side(tmp_path)
    try:
        _, (store,) = stored(side, "x", CHUNK)
        side.worker_report(WorkerReport(disk_failed=Counter({store.key: 1})))
        (again,) = side.build_meta().rewrites
        side.worker_report(WorkerReport(disk_written=Counter({store.key: 1})))
        disk, host = side.stack.indexes[TierName.DISK], side.stack.indexes[TierName.HOST]
        assert disk.slot_of(store.key) == again.disk_slot and not host.pinned(store.key)
        assert side.counters["disk_written_chunks"] == 1
        assert side.build_meta().rewrites == []
    finally:
        side.close()


def test_an_engine_that_hands_nothing_off_does_not_write_a_failed_chunk_again(tmp_path):
    side = producer_side(tmp_path, role=Role.BOTH)
    try:
        _, (store,) = stored(side, "x", CHUNK)
        side.worker_report(WorkerReport(disk_failed=Counter({store.key: 1})))
        assert side.build_meta().rewrites == []
        assert not side.stack.indexes[TierName.HOST].pinned(store.key)
        assert side.counters["pool_given_up_chunks"] == 0
    finally:
        side.close()


def test_a_chunk_written_again_goes_to_a_path_in_service_or_is_given_up_at_once(tmp_path):
    """Its path went out of service with the failure (an I/O error, a vanished directory):
    written again on the other path; with none left in service, given up at once."""
    side = producer_side(tmp_path, paths=2)
    try:
        _, (first, second) = stored(side, "x", 2 * CHUNK)
        down = first.disk_slot % 2
        side.worker_report(WorkerReport(disk_failed=Counter({first.key: 1}),
                                        paths_down=Counter({down: 1})))
        (again,) = side.build_meta().rewrites
        assert again.key == first.key and again.disk_slot % 2 != down
        side.worker_report(WorkerReport(disk_failed=Counter({second.key: 1, first.key: 1}),
                                        paths_down=Counter({1 - down: 1})))
        assert side.build_meta().rewrites == []  # no disk slot in service: nowhere to go
        host = side.stack.indexes[TierName.HOST]
        assert not host.pinned(first.key) and not host.pinned(second.key)
        assert side.counters["pool_given_up_chunks"] == 2
    finally:
        side.close()


def test_an_idle_producer_is_stepped_while_a_hand_offs_writes_are_out_for_a_while(tmp_path):
    """vLLM steps an engine without requests only while the connector has work pending: a
    producer's pool writes after a hand-off (their outcomes, a failed one's write again),
    for as long as a consumer waits for them (load_timeout) at most."""
    side = producer_side(tmp_path, load_timeout="300ms")
    try:
        req, (store,) = stored(side, "x", CHUNK)
        assert not side.has_pending_push_work()  # nothing handed off
        side.handoff_params(req)
        side.request_finished("x")
        assert side.has_pending_push_work()  # its disk write is out
        side.worker_report(WorkerReport(disk_failed=Counter({store.key: 1})))
        assert side.has_pending_push_work()  # to be written again
        side.build_meta()
        assert side.has_pending_push_work()  # written again: out
        side.worker_report(WorkerReport(disk_written=Counter({store.key: 1})))
        assert not side.has_pending_push_work()  # in the pool
        held, _ = stored(side, "y", CHUNK, seed=2)
        side.handoff_params(held)
        assert side.has_pending_push_work()
        time.sleep(0.35)  # a write out past a consumer's wait (a hung drive) steps no more
        assert not side.has_pending_push_work()
    finally:
        side.close()
    both = producer_side(tmp_path / "both", role=Role.BOTH)
    try:
        req, _ = stored(both, "x", CHUNK)
        both.handoff_params(req)
        assert not both.has_pending_push_work()
    finally:
        both.close()


class Stack:
    """Where chunks are for ``RemoteWrites``: every key of ``in_host`` in a host slot."""

    def __init__(self, in_host) -> None:
        self.slots = {key: i for i, key in enumerate(in_host)}
        self.indexes = {TierName.HOST: SimpleNamespace(pin=lambda key: None, num_slots=64)}
        self.pins = Counter()

    def locate(self, key):
        return Location(TierName.HOST, self.slots[key]) if key in self.slots else None

    def unpin(self, key, location):
        self.pins[key] -= 1


def test_a_producers_failed_remote_write_is_written_again_from_host_memory_twice_at_most():
    key, counters, down = ChunkKey(b"k" * 16), Counter(), [False]
    writes = RemoteWrites(Stack([key]), counters, 1, 0, 8, lambda: down[0], tries=3)
    assert writes.with_store(key)  # written right after its host copy
    writes.stored(key, Location(TierName.HOST, 0))
    for _ in range(2):
        writes.apply(WorkerReport(remote_failed=Counter({key: 1})))
        assert writes.busy()  # to be written again
        down[0] = True
        writes.forget_lost()
        assert writes.take_new() == []  # not while the store is out of service
        down[0] = False
        writes.forget_lost()
        assert [w.key for w in writes.take_new()] == [key] and writes.holds(key)
    writes.apply(WorkerReport(remote_failed=Counter({key: 1})))
    writes.forget_lost()
    assert writes.take_new() == [] and not writes.busy() and not writes.holds(key)
    assert (counters["remote_failed_chunks"], counters["pool_rewritten_chunks"],
            counters["pool_given_up_chunks"]) == (3, 2, 1)


def test_a_failed_remote_write_is_not_written_again_on_other_roles_nor_once_out_of_memory():
    key, counters = ChunkKey(b"k" * 16), Counter()
    once = RemoteWrites(Stack([key]), counters, 1, 0, 8, lambda: False)  # not a producer
    assert once.with_store(key)
    once.stored(key, Location(TierName.HOST, 0))
    once.apply(WorkerReport(remote_failed=Counter({key: 1})))
    once.forget_lost()
    assert once.take_new() == [] and not once.busy()
    gone = RemoteWrites(Stack([]), counters, 1, 0, 8, lambda: False, tries=3)
    assert gone.with_store(key)
    gone.apply(WorkerReport(remote_failed=Counter({key: 1})))
    gone.forget_lost()  # evicted from host memory meanwhile: nothing to write it from
    assert gone.take_new() == [] and counters["pool_given_up_chunks"] == 1


def test_a_failed_write_pushed_out_of_a_full_queue_of_writes_again_counts_as_given_up():
    keys, counters, down = [ChunkKey(bytes([i]) * 16) for i in range(3)], Counter(), [False]
    writes = RemoteWrites(Stack(keys), counters, 1, 0, 8, lambda: down[0], tries=3)
    writes._capacity = 2  # more failed writes than the queue of writes again holds
    for key in keys:
        assert writes.with_store(key)
        writes.stored(key, Location(TierName.HOST, 0))
    down[0] = True  # the store goes out of service as the writes fail
    for key in keys:
        writes.apply(WorkerReport(remote_failed=Counter({key: 1})))
    assert counters["pool_given_up_chunks"] == 1  # the oldest, pushed out
    down[0] = False
    writes.forget_lost()
    assert [w.key for w in writes.take_new()] == keys[1:]
