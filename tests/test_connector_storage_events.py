"""Chunks on disk named in KV events from their slots' token records
(``scheduler/storage_events.py``, ``scheduler/event_feed.py``): an engine restarted on its
disk, and an engine following another's segment of a shared directory, publish those
chunks with the hashes vLLM gives their tokens, without a request for them; a record that
lies, or no record, names nothing; ``STORAGE`` is removed only when no holder is left."""

import threading
import time
from array import array
from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import Request

from kvtier.config.settings import load_config
from kvtier.connector.common.messages import StepPlan, WorkerReport
from kvtier.connector.scheduler.events import KVEvents
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.scheduler.storage_events import StorageEvents
from kvtier.connector.vllm_events import VllmHashing
from kvtier.io.format import Codec, SlotHeader
from kvtier.io.token_record import encode_record, read_record
from kvtier.keys import ChunkKey
from kvtier.segment.index_file import read_disk_index
from kvtier.tiers.base import TierName
from tests.helpers.vllm_requests import vllm_chain
from tests.helpers.vllm_requests import vllm_request as make_request
from tests.helpers.worker_side import GEO, worker

BLOCK = GEO.block_tokens
TOKENS = list(range(3000, 3064))  # two chunks of 32
OTHER = list(range(5000, 5064))
HASHING = VllmHashing(SimpleNamespace(cache_config=SimpleNamespace(
    prefix_caching_hash_algo="sha256")), BLOCK)


class Recorded:
    """A stand-in for ``VllmEvents``: (kind, medium, hashes, tokens) of each event."""

    extra_keys = HASHING.extra_keys

    def stored(self, blocks, medium):
        return [("stored", medium, blocks.hashes, blocks.tokens.tolist())]

    def removed(self, blocks, medium):
        return [("removed", medium, blocks.hashes, None)]


def vllm_request(name: str, tokens: list[int], salt: str | None = None) -> Request:
    return make_request(name, tokens, BLOCK, salt=salt)


def chain(tokens: list[int]) -> list[bytes]:
    return vllm_chain(tokens, BLOCK)


def side(tmp_path, name: str, events: bool = True) -> SchedulerSide:
    cfg = load_config({"chunk_tokens": 2 * BLOCK, "host_capacity": 4 * GEO.chunk_bytes,
                       "disk_paths": [str(tmp_path)], "instance_id": name, "disk_min_free": 0,
                       "disk_capacity": 8 * (4096 + GEO.chunk_bytes)}, environ={})
    return SchedulerSide(cfg, GEO, [GEO.namespace("m", "", 1, 0)], 1,
                         Recorded() if events else None, hashing=HASHING)


def write(tmp_path, name: str, tokens: list[int], salt: str | None = None) -> list[bytes]:
    """Engine ``name`` computes ``tokens`` and writes their chunks through to disk; closed."""
    s, w = side(tmp_path, name, events=False), worker(tmp_path, instance_id=name)[0]
    meta = s.build_meta()
    s.plan_stores(vllm_request("r", tokens, salt), ([1, 2, 3, 4],), len(tokens), meta)
    w.save(meta)
    assert w.drain(5)
    s.worker_report(w.report())
    assert s.counters["disk_written_chunks"] == 2, s.counters
    s.close()
    w.close(5)
    return [st.record for st in meta.stores]


def events_until(s: SchedulerSide, count: int, timeout: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, got
        got += s.take_events()
        time.sleep(0.02)
    time.sleep(0.1)
    return got + s.take_events()


def test_a_plain_chunk_carries_its_token_record_and_a_salted_one_none(tmp_path):
    s = side(tmp_path, "a")
    meta = StepPlan()
    s.plan_stores(vllm_request("r", TOKENS), ([1, 2, 3, 4],), 64, meta)
    hashes = chain(TOKENS)
    assert len(meta.stores) == 2
    for n, store in enumerate(meta.stores):
        made = SlotHeader(b"n" * 16, store.key, Codec.NONE, 1, 1, 1, 1, 1).encode(
            record=store.record)
        record = read_record(made, 0)
        assert record is not None
        assert record.tokens.tolist() == TOKENS[32 * n:32 * (n + 1)]
        assert record.parent == (hashes[1] if n else b"")
    meta = StepPlan()
    s.plan_stores(vllm_request("s", OTHER, salt="tenant"), ([5, 6, 7, 8],), 64, meta)
    first, second = (st.record for st in meta.stores)
    assert first == b""  # its first block's hash takes the salt in: a record keeps none
    assert second  # its own blocks hash only tokens, chained from the salted parent
    s.close()


def test_a_restarted_engine_publishes_its_disk_without_a_request(tmp_path):
    write(tmp_path, "a", TOKENS)
    s = side(tmp_path, "a")
    assert s.recovered == 2
    got = events_until(s, 2)
    hashes = chain(TOKENS)
    assert sorted(got) == sorted([("stored", "STORAGE", tuple(hashes[0:2]), TOKENS[:32]),
                                  ("stored", "STORAGE", tuple(hashes[2:4]), TOKENS[32:])])
    store = StepPlan()
    s.plan_stores(vllm_request("r", TOKENS), ([1, 2, 3, 4],), 64, store)
    assert s.take_events() == [] and not store.stores  # on disk, known: nothing new
    s.close()


def test_another_engines_chunks_are_published_until_no_segment_holds_them(tmp_path):
    write(tmp_path, "a", TOKENS)
    b = side(tmp_path, "b")
    assert b.recovered == 0 and b.others is not None
    got = events_until(b, 2)
    assert [e[:2] for e in got] == [("stored", "STORAGE")] * 2
    assert {e[2] for e in got} == {tuple(chain(TOKENS)[0:2]), tuple(chain(TOKENS)[2:4])}
    first = b.chunk_keys(vllm_request("r", TOKENS), 1)[0]
    refs = b.others.find(first)
    assert refs is not None
    b.others.drop(refs)  # a failed read, say: no other segment holds it now
    gone = events_until(b, 1)
    assert gone == [("removed", "STORAGE", tuple(chain(TOKENS)[0:2]), None)]
    b.close()


def test_a_loss_of_a_chunk_never_named_queues_nothing(tmp_path):
    """Another segment losing a chunk this engine never named nor reads names nothing: it
    is not queued. An idle engine, whose reads wait for vLLM to take what was found, queued
    every such loss of the other engines' churn without bound. Found by a review."""
    events = StorageEvents([str(tmp_path)], GEO.namespace("m", "", 1, 0), "me",
                           4096 + GEO.chunk_bytes, GEO, HASHING)
    told = threading.Event()
    listeners = []

    def listen(changed):
        listeners.append(changed)
        told.set()
        return []

    events.start([], listen)
    try:
        assert told.wait(10)
        for n in range(10_000):
            listeners[0](ChunkKey(n.to_bytes(16, "big")), None)
        time.sleep(0.2)
        assert events.drain() == []
    finally:
        events.close()


def held_back(s: SchedulerSide, timeout: float = 10.0) -> None:
    """Until one chunk is unnamed and one named waits for it (anchors.py), no event out."""
    deadline = time.monotonic() + timeout
    while s.counters["kv_events_unnamed"] < 1 or s.feed is None or s.feed.waiting < 1:
        assert time.monotonic() < deadline, (s.counters, s.feed and s.feed.waiting)
        assert s.take_events() == []
        time.sleep(0.02)
    assert s.take_events() == [] and s.counters["kv_events_unnamed"] == 1


def test_a_chunk_without_a_record_is_counted_and_the_next_one_waits_for_it(tmp_path):
    write(tmp_path, "a", OTHER, salt="tenant")  # the first chunk has no record
    b = side(tmp_path, "b")
    held_back(b)  # the second has, chained from the salted first: not published before it
    b.close()


def test_a_record_whose_tokens_do_not_make_its_key_names_nothing(tmp_path):
    from kvtier.connector.scheduler.chunk_records import record_blocks
    from kvtier.io.token_record import TokenRecord

    s = side(tmp_path, "a")
    key = s.chunk_keys(vllm_request("r", TOKENS), 1)[0]
    ns = GEO.namespace("m", "", 1, 0)
    right = read_record(SlotHeader(b"n" * 16, key, Codec.NONE, 1, 1, 1, 1, 1).encode(
        record=encode_record(b"", array("i", TOKENS[:32]))), 0)
    assert right is not None and record_blocks(right, key, GEO, ns, HASHING) is not None
    lied = TokenRecord(b"", array("i", OTHER[:32]))
    assert record_blocks(lied, key, GEO, ns, HASHING) is None
    wrong_parent = TokenRecord(b"\x07" * 32, right.tokens)
    assert record_blocks(wrong_parent, key, GEO, ns, HASHING) is None
    assert record_blocks(TokenRecord(b"", right.tokens[:16]), key, GEO, ns, HASHING) is None
    s.close()


def test_storage_is_removed_only_when_neither_this_disk_nor_another_segment_holds_it():
    events = KVEvents(GEO, Recorded(), Counter())
    req = vllm_request("r", TOKENS)
    from kvtier.connector.scheduler.events import chunk_blocks

    blocks = chunk_blocks(req, GEO, 0)
    assert blocks is not None
    key = b"k" * 16
    events.found(key, blocks, shared=True, on_disk=False)  # type: ignore[arg-type]
    events.record(key, req, 0)  # type: ignore[arg-type]
    events.stored(key, TierName.DISK)  # type: ignore[arg-type]
    assert [e[:2] for e in events.take()] == [("stored", "STORAGE")]  # once for both
    events.shared_gone(key)  # type: ignore[arg-type]
    assert events.take() == [] and len(events) == 1  # still on this engine's disk
    events.removed(key, TierName.DISK)  # type: ignore[arg-type]
    events.left(key)  # type: ignore[arg-type]
    assert [e[:2] for e in events.take()] == [("removed", "STORAGE")] and len(events) == 0


def test_a_chunk_is_named_after_the_chunk_before_it_where_both_are_found_together():
    from kvtier.connector.scheduler.events import ChunkBlocks
    from kvtier.connector.scheduler.storage_events import Found, parents_first

    def chunk(name: str, parent: str | None) -> Found:
        blocks = ChunkBlocks((name.encode() + b"0", name.encode() + b"1"),
                             None if parent is None else parent.encode() + b"1", array("i"))
        return Found(name.encode() * 16, blocks, True)

    a, b, c, other = chunk("a", None), chunk("b", "a"), chunk("c", "b"), chunk("x", "y")
    gone = Found(b"g" * 16, None, True)
    assert parents_first([c, other, b, a]) == [a, b, c, other]
    assert parents_first([c, b, gone, a]) == [b, c, gone, a]  # not across a removal
    assert parents_first([a, c, b]) == [a, b, c]
    assert parents_first([]) == []


def test_a_co_writers_record_that_lies_about_its_tokens_is_not_published(tmp_path):
    import os

    from kvtier.io.format import decode_header
    from kvtier.segment.index_file import SlotLayout
    from kvtier.segment.names import SLOT_FILE

    write(tmp_path, "a", TOKENS)
    first = side(tmp_path, "a", events=False).chunk_keys(vllm_request("r", TOKENS), 1)[0]
    path = tmp_path / GEO.namespace("m", "", 1, 0).id / "writers" / "a" / SLOT_FILE.format(0)
    stride = SlotLayout(GEO.chunk_bytes, 1, 1 << 30).stride
    fd = os.open(path, os.O_RDWR)
    try:
        for slot in range(8):
            header = decode_header(os.pread(fd, 4096, slot * stride))
            if header.key == first:  # the same key, other tokens: its own checksum right
                lie = header.encode(record=encode_record(b"", array("i", OTHER[:32])))
                assert lie is not None and os.pwrite(fd, lie, slot * stride) == 4096
                break
        else:
            raise AssertionError("chunk 0 not found in the segment")
    finally:
        os.close(fd)
    b = side(tmp_path, "b")
    held_back(b)  # neither the lie nor the chunk after it is published
    b.close()


def test_a_path_back_after_being_out_since_the_start_publishes_its_chunks(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    write(root, "a", TOKENS)
    root.rename(tmp_path / "away")
    s = side(root, "a")  # the path missing at start: nothing of it known
    assert s.recovered == 0 and s.take_events() == []
    s.worker_report(WorkerReport(paths_down=Counter({0: 1})))
    (tmp_path / "away").rename(root)
    held = read_disk_index([str(root)], GEO.namespace("m", "", 1, 0), s.disk_layout, "a")
    assert len(held) == 2
    s.worker_report(WorkerReport(paths_up=Counter({0: 1}), paths_found={
        (0, slot, key): (1, header.generation) for key, (slot, header) in held.items()}))
    s.build_meta()  # adopted at the next step
    hashes = chain(TOKENS)
    assert sorted(events_until(s, 2)) == sorted([
        ("stored", "STORAGE", tuple(hashes[0:2]), TOKENS[:32]),
        ("stored", "STORAGE", tuple(hashes[2:4]), TOKENS[32:])])
    s.close()


def test_a_loss_told_after_a_read_queued_behind_a_loss_waits_after_that_read():
    """Another segment's chunk gained, lost, gained and lost again before the reader gets to
    them: the last loss is queued after the second read. Before, it was dropped as a loss
    already waiting, and the chunk stayed published as STORAGE with no segment holding it."""
    from kvtier.shared.followed import OtherChunk

    reader = StorageEvents(["/nowhere"], GEO.namespace("m", "", 1, 0), "me", 4096, GEO, HASHING)
    key, chunk = ChunkKey(b"x" * 16), OtherChunk("a", 0, 7, ChunkKey(b"x" * 16), 0, 0)
    for told in (chunk, None, chunk, None, None):
        reader._changed(key, told)
    assert ["loss" if item == key else "read" for item in reader._todo] == [
        "read", "loss", "read", "loss"]
