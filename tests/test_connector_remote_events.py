"""The remote store's chunks in every engine's KV events (``scheduler/remote_events.py``),
against a real redis-server: an engine that writes a chunk appends its token record to the
store's log; another engine, which never saw a request for it, publishes it with vLLM's
hashes, as held REMOTE, and as removed once the store lost it; a log entry that lies names
nothing."""

import time
from array import array

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.v1.request import Request

from kvtier.connector.scheduler import remote_events
from kvtier.io.result import IOStatus
from kvtier.io.token_record import encode_record
from kvtier.keys import ChunkKey
from kvtier.remote.redis_tier import RedisTier
from tests.helpers.recorded_events import HASHING, Recorded, events_until
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.remote_engine import Engine
from tests.helpers.scheduler_side import BLOCK, CHUNK, GEO
from tests.helpers.vllm_requests import vllm_chain
from tests.helpers.vllm_requests import vllm_request as make_request

pytestmark = needs_redis
TOKENS = list(range(7000, 7000 + 2 * CHUNK))
def vllm_request(name: str, tokens: list[int]) -> Request:
    return make_request(name, tokens, BLOCK)


def chain(tokens: list[int]) -> list[bytes]:
    return vllm_chain(tokens, BLOCK)


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setattr(remote_events, "FOLLOW_EVERY_S", 0.05)
    monkeypatch.setattr(remote_events, "CHECK_EVERY_S", 0.3)
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def test_another_engine_publishes_the_chunks_one_wrote_until_the_store_loses_them(server):
    a = Engine(server, hashing=HASHING)
    b = Engine(server, events=Recorded(), hashing=HASHING)
    try:
        assert b.scheduler.take_events() == []  # starts following the log
        a.store(vllm_request("r", TOKENS), [1, 2, 3, 4])
        assert a.scheduler.counters["remote_written_chunks"] == 2
        a.step()  # the records of the chunks written go to the store's log
        got = events_until(b, 2)
        hashes = chain(TOKENS)
        assert sorted(got) == sorted([
            ("stored", "STORAGE", tuple(hashes[0:2]), TOKENS[:CHUNK], True),
            ("stored", "STORAGE", tuple(hashes[2:4]), TOKENS[CHUNK:], True)])
        client = server.client()
        client.delete(*[k for k in client.scan_iter(match="kvtier:*") if b":log:" not in k])
        gone = events_until(b, 2)
        assert sorted(e[:3] + e[4:] for e in gone) == sorted([
            ("removed", "STORAGE", tuple(hashes[0:2]), True),
            ("removed", "STORAGE", tuple(hashes[2:4]), True)])
        assert b.scheduler.events is not None and len(b.scheduler.events) == 0  # forgotten
    finally:
        a.close()
        b.close()


def test_a_chunk_the_store_will_not_answer_for_holds_no_later_chunk_back(server, monkeypatch):
    """A cluster slot out of service for long: the store answers for the other chunks of
    the log, which are named, and the refused one is asked about again each round until it
    is answered (then the chunk after it in its prompt follows). The log was read again
    from the same entry, and no later chunk was named while that slot was out. Found by a
    review."""
    a = Engine(server, hashing=HASHING)
    b = Engine(server, events=Recorded(), hashing=HASHING)
    other = list(range(9000, 9000 + 2 * CHUNK))
    try:
        assert b.scheduler.take_events() == []  # starts following the log
        refused = b.scheduler.chunk_keys(vllm_request("r", TOKENS), 1)[0]
        tier, out = b.scheduler.presence.tiers[0], [True]
        real = tier.exists_answered

        def answered(keys):
            there = real(keys)
            return there if there is None or out[0] else [
                None if key == refused else held for key, held in zip(keys, there, strict=True)]

        monkeypatch.setattr(tier, "exists_answered", answered)
        out[0] = False
        for name, tokens in (("r", TOKENS), ("q", other)):
            a.store(vllm_request(name, tokens), [1, 2, 3, 4])
            a.step()  # the records of the chunks written go to the store's log
        hashes, others = chain(TOKENS), chain(other)
        got = events_until(b, 2)  # r's second chunk waits for its first, as vLLM's blocks do
        assert [e[2] for e in got] == [tuple(others[0:2]), tuple(others[2:4])]
        out[0] = True  # the slot is served again
        assert [e[2] for e in events_until(b, 2)] == [tuple(hashes[0:2]), tuple(hashes[2:4])]
    finally:
        a.close()
        b.close()


def test_a_chunk_written_once_it_earned_its_hits_is_logged_with_its_record(server):
    a = Engine(server, hashing=HASHING, remote_min_hits=1)
    b = Engine(server, events=Recorded(), hashing=HASHING)
    try:
        b.scheduler.take_events()
        a.store(vllm_request("r", [*TOKENS, 1]), [1, 2, 3, 4, 5])
        a.step()
        assert a.scheduler.counters["remote_written_chunks"] == 0  # no hit yet
        again = vllm_request("again", [*TOKENS, 2])
        assert a.match(again) == (2 * CHUNK, False)
        a.scheduler.plan_load(again, ([9, 10, 11, 12, 13],), 0, 2 * CHUNK)
        for _ in range(4):  # the load, the writes it earned, their outcomes, the log
            a.step()
        assert a.scheduler.counters["remote_written_chunks"] == 2
        hashes = chain(TOKENS)
        assert sorted(events_until(b, 2)) == sorted([
            ("stored", "STORAGE", tuple(hashes[0:2]), TOKENS[:CHUNK], True),
            ("stored", "STORAGE", tuple(hashes[2:4]), TOKENS[CHUNK:], True)])
    finally:
        a.close()
        b.close()


def logged(engine: Engine, tier: RedisTier, count: int, audit: bool = False,
           timeout: float = 15.0) -> dict[bytes, bytes]:
    """Step ``engine`` (a check of the store due at each step, with ``audit``) until the
    store's log holds ``count`` entries (its appends run in the background): key -> record."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, engine.scheduler.counters
        if audit and engine.scheduler._audit._out is None:
            engine.scheduler._audit._due = 0.0  # white-box: a check is due now
        engine.step()
        answer = tier.read_records(b"0", 16)
        if answer is not None and len(answer[1]) >= count:
            return dict(answer[1])
        time.sleep(0.02)


def test_chunks_the_store_lost_and_written_again_from_host_memory_are_logged_again(server):
    a = Engine(server, hashing=HASHING)
    tier = RedisTier(server.url, a.ns, GEO.chunk_bytes)
    try:
        a.store(vllm_request("r", TOKENS), [1, 2, 3, 4])
        keys = a.scheduler.chunk_keys(vllm_request("r", TOKENS), 2)
        assert sorted(logged(a, tier, len(keys))) == sorted(keys)
        server.client().flushall()  # the store loses everything, its log too (connections stay)
        entries = logged(a, tier, len(keys), audit=True)  # checks find the losses: written again
        assert a.scheduler.counters["remote_written_chunks"] == 4
        assert sorted(entries) == sorted(keys)  # with the records the workers kept
        assert entries[keys[0]] == encode_record(b"", array("i", TOKENS[:CHUNK]))
    finally:
        tier.close()
        a.close()


def test_a_log_entry_that_lies_is_damaged_or_names_a_value_gone_names_nothing(server):
    b = Engine(server, events=Recorded(), hashing=HASHING)
    try:
        b.scheduler.take_events()
        key = b.scheduler.chunk_keys(vllm_request("r", TOKENS), 1)[0]
        tier = RedisTier(server.url, b.ns, GEO.chunk_bytes)
        lie = encode_record(b"", array("i", TOKENS[CHUNK:]))  # other tokens under this key
        right = encode_record(b"", array("i", TOKENS[:CHUNK]))
        assert tier.append_records([(key, lie), (key, right[:-1]), (ChunkKey(b"short"), right),
                                    (key, right + b"x")])
        deadline = time.monotonic() + 10
        while b.scheduler.counters["kv_events_unnamed"] < 4:
            assert time.monotonic() < deadline, b.scheduler.counters
            assert b.scheduler.take_events() == []
            time.sleep(0.02)
        # the truth, after all that, of a value the store does not hold (evicted long
        # before the log is trimmed): nothing is published
        assert tier.append_records([(key, right)])
        time.sleep(0.5)
        assert b.scheduler.take_events() == [] and b.scheduler.counters["kv_events_unnamed"] == 4
        assert tier.put_many([(key, np.zeros(GEO.chunk_bytes, np.uint8))])[0].status is IOStatus.OK
        assert tier.append_records([(key, right)])  # written again, logged again
        assert [e[:2] + e[4:] for e in events_until(b, 1)] == [("stored", "STORAGE", True)]
        tier.close()
    finally:
        b.close()


@pytest.mark.parametrize("how", ["read missing", "read damaged", "removed as wrong"])
def test_a_chunk_the_engine_learnt_the_store_lost_is_removed_at_once(server, monkeypatch, how):
    """A read from the store that answered missing or damaged, or a sampled check that
    removed the chunk as wrong, is certain news: the removal goes out at the next take,
    not at a check of the store (every 10 s over up to 65,536 chunks, here never). Found
    by a review."""
    monkeypatch.setattr(remote_events, "CHECK_EVERY_S", 3600.0)
    a = Engine(server, hashing=HASHING)
    b = Engine(server, events=Recorded(), hashing=HASHING)
    try:
        assert b.scheduler.take_events() == []  # starts following the log
        a.store(vllm_request("r", TOKENS), [1, 2, 3, 4])
        a.step()  # the records of the chunks written go to the store's log
        assert len(events_until(b, 2)) == 2
        req = vllm_request("q", [*TOKENS, 1])
        keys = b.scheduler.chunk_keys(req, 2)
        if how == "removed as wrong":
            assert b.scheduler.presence is not None
            b.scheduler.presence.remove(keys)  # as a sampled check that found them wrong
        else:
            assert b.match(req) == (2 * CHUNK, True)
            client = server.client()
            for name in [k for k in client.scan_iter(match="kvtier:*") if b":log:" not in k]:
                if how == "read missing":
                    client.delete(name)
                else:
                    value = bytearray(client.get(name))
                    value[-7] ^= 0x5A
                    client.set(name, bytes(value))
            b.scheduler.plan_load(req, ([9, 10, 11, 12],), 0, 2 * CHUNK)
            b.step()
            assert b.worker.take_invalid_blocks() == {9, 10, 11, 12}
        hashes = chain(TOKENS)
        assert sorted(e[:3] + e[4:] for e in b.scheduler.take_events()) == sorted([
            ("removed", "STORAGE", tuple(hashes[0:2]), True),
            ("removed", "STORAGE", tuple(hashes[2:4]), True)])
    finally:
        a.close()
        b.close()
