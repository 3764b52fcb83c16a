"""The scheduler side's periodic check of what the remote store still holds
(``RemoteAudit``): chunks this engine wrote are asked about again, a batch at a time, oldest
checked first; those the store lost (a restart empty, an eviction) are written again from
host memory. Against a fake store and clock, then two engines on a redis-server that
restarts empty."""

import time
from collections import Counter
from types import SimpleNamespace

import pytest

from kvtier.connector.common.messages import WorkerReport
from kvtier.connector.scheduler.remote_audit import RemoteAudit
from kvtier.connector.scheduler.remote_presence import RemotePresence
from kvtier.connector.scheduler.remote_writes import RemoteWrites
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import Location
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.remote_engine import Engine
from tests.helpers.scheduler_side import CHUNK, request

KEYS = [ChunkKey(bytes([i])) for i in range(10)]
HOST = TierName.HOST


class Store:
    """A remote tier holding ``held``; every lookup recorded."""

    def __init__(self, held) -> None:
        self.held, self.asked, self.down = set(held), [], False

    def exists(self, keys):
        self.asked.append(list(keys))
        return [key in self.held for key in keys]

    def exists_answered(self, keys):
        held = self.exists(keys)
        return None if self.down else held

    def close(self):
        pass


class Stack:
    """Where chunks are: every key of ``in_host`` in a host slot of its own."""

    def __init__(self, in_host) -> None:
        self.slots = {key: i for i, key in enumerate(in_host)}
        self.indexes = {HOST: SimpleNamespace(pin=lambda key: None, num_slots=64)}

    def locate(self, key):
        return Location(HOST, self.slots[key]) if key in self.slots else None

    def unpin(self, key, location):
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def parts(held, in_host=(), min_hits=0):
    store, clock, counters = Store(held), Clock(), Counter()
    presence = RemotePresence([store], wait_s=30)
    writes = RemoteWrites(Stack(in_host), counters, 1, min_hits, 64, lambda: presence.down,
                          presence.take_absent)
    for key in KEYS:
        writes.in_store(key)
    audit = RemoteAudit(presence, writes, counters, every_s=10, batch=4, clock=clock)
    return store, clock, counters, presence, writes, audit


def settle(audit, presence):
    """Ticks until the check out is answered and taken."""
    for _ in range(200):
        audit.tick()
        if audit._out is None and not presence._absent:
            return
        time.sleep(0.01)
    raise AssertionError("the check was never answered")


def test_nothing_is_asked_before_a_check_is_due_then_a_batch_oldest_first():
    store, clock, counters, presence, _, audit = parts(KEYS)
    try:
        audit.tick()
        assert store.asked == []
        clock.now = 10
        audit.tick()
        settle(audit, presence)
        assert store.asked == [KEYS[:4]] and counters["remote_audited_chunks"] == 4
        clock.now = 15
        audit.tick()
        assert len(store.asked) == 1  # none lost: the next check waits its turn
        for now in (20, 30):
            clock.now = now
            audit.tick()
            settle(audit, presence)
        assert store.asked[1:] == [KEYS[4:8], KEYS[8:] + KEYS[:2]]  # round robin
        assert counters["remote_lost_chunks"] == 0
    finally:
        presence.close()


def test_chunks_the_store_lost_are_written_again_from_host_memory_at_once():
    lost = set(KEYS[:3])
    store, clock, counters, presence, writes, audit = parts(set(KEYS) - lost, in_host=KEYS[:2])
    try:
        clock.now = 10
        audit.tick()
        settle(audit, presence)
        rewritten = writes.take_new()
        assert sorted(w.key for w in rewritten) == sorted(KEYS[:2])  # KEYS[2]: not in host
        assert counters["remote_lost_chunks"] == 3
        assert writes.with_store(KEYS[2])  # forgotten: written again at its next store
        assert len(store.asked) == 2  # losses found: the next check went at once
    finally:
        presence.close()


def test_with_min_hits_a_lost_chunk_is_only_forgotten():
    _, clock, counters, presence, writes, audit = parts(set(), in_host=KEYS, min_hits=2)
    try:
        clock.now = 10
        audit.tick()
        settle(audit, presence)
        assert writes.take_new() == [] and counters["remote_lost_chunks"] >= 4
    finally:
        presence.close()


def test_no_check_while_the_store_is_out_of_service():
    store, clock, counters, presence, _, audit = parts(KEYS)
    try:
        store.down = True
        clock.now = 100
        audit.tick()
        assert store.asked == [] and counters["remote_audited_chunks"] == 0
    finally:
        presence.close()


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


@needs_redis
def test_a_store_restarted_empty_gets_this_engines_chunks_again_and_another_engine_hits(server):
    a, b = Engine(server), Engine(server)
    try:
        req = request("r", 4 * CHUNK + 1, seed=3)
        a.store(req, list(range(1, 9)))
        assert a.scheduler.counters["remote_written_chunks"] == 4
        server.stop()
        server.start()  # empty: a restart without persistence
        assert len(list(server.client().scan_iter(match="kvtier:*"))) == 0
        audit = a.scheduler._audit
        for _ in range(200):  # the first check may meet the connection the restart closed
            if audit._out is None:
                audit._due = 0.0  # white-box: a check is due now
            a.step()
            if a.scheduler.counters["remote_written_chunks"] == 8:
                break
            time.sleep(0.02)
        assert a.scheduler.counters["remote_lost_chunks"] == 4
        assert a.scheduler.counters["remote_written_chunks"] == 8
        assert b.match(request("q", 4 * CHUNK + 1, seed=3)) == (4 * CHUNK, True)
    finally:
        a.close()
        b.close()


def test_lost_chunks_past_the_writes_in_flight_are_written_as_room_comes():
    """A restart lost more host chunks than may be written at once (``max_pending``): the
    rest wait for room, and are written then, not dropped for good."""
    store, clock, counters = Store(set()), Clock(), Counter()
    presence = RemotePresence([store], wait_s=30)
    writes = RemoteWrites(Stack(KEYS), counters, 1, 0, 2, lambda: presence.down,
                          presence.take_absent)
    for key in KEYS:
        writes.in_store(key)
    audit = RemoteAudit(presence, writes, counters, every_s=10, batch=len(KEYS), clock=clock)
    rewritten: list = []
    try:
        clock.now = 10
        settle(audit, presence)
        for _ in range(len(KEYS)):  # a step each: the writes out end, room for two more
            writes.forget_lost()
            new = writes.take_new()
            rewritten += [w.key for w in new]
            writes.apply(WorkerReport(remote_written=Counter({w.key: 1 for w in new})))
        assert sorted(rewritten) == sorted(KEYS) and counters["remote_dropped_chunks"] == 0
    finally:
        presence.close()


def test_keys_a_store_refused_to_answer_for_are_not_lost():
    """(a cluster's slot moving answers ASK or TRYAGAIN for its keys: counted lost, every
    step checked again at once, for as long as the slot moved)"""
    store, clock, counters, presence, writes, audit = parts(KEYS, in_host=KEYS)
    answer = store.exists_answered
    store.exists_answered = lambda keys: [None if key in KEYS[:2] else a
                                          for key, a in zip(keys, answer(keys), strict=True)]
    try:
        clock.now = 10
        audit.tick()
        settle(audit, presence)
        assert counters["remote_lost_chunks"] == 0 and writes.take_new() == []
        clock.now = 11
        audit.tick()
        assert len(store.asked) == 1  # none lost: the next check waits its turn
    finally:
        presence.close()
