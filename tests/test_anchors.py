"""Chunks named from token records wait for the chunk before them in their prompt
(``scheduler/anchors.py``): a prefix-indexing router drops a block whose parent it has not
seen (tests/test_router_anchors.py)."""

from array import array
from collections import Counter

from kvtier.connector.scheduler import anchors as anchors_module
from kvtier.connector.scheduler.anchors import Anchors
from kvtier.connector.scheduler.events import ChunkBlocks
from kvtier.connector.scheduler.storage_events import Found
from kvtier.keys import ChunkKey


def chunk(n: int, parent: int | None) -> Found:
    """Chunk ``n`` (its blocks end with hash n) after chunk ``parent``."""
    blocks = ChunkBlocks((b"h%d-0" % n, b"h%d" % n), None if parent is None else b"h%d" % parent,
                         array("i", [n]))
    return Found(ChunkKey(b"k%d" % n), blocks, shared=True)


def gone(n: int) -> Found:
    return Found(ChunkKey(b"k%d" % n), None, shared=True)


def names(found: list[Found]) -> list[str]:
    return [f.key.decode() + ("" if f.blocks else " gone") for f in found]


def nothing(_: bytes) -> bool:
    return False


def test_a_chunk_waits_for_its_parent_then_follows_it_with_its_own_children():
    a = Anchors(Counter())
    assert names(a.order([chunk(3, 2), chunk(2, 1)], nothing)) == []
    assert len(a) == 2
    assert names(a.order([chunk(1, None)], nothing)) == ["k1", "k2", "k3"]
    assert len(a) == 0


def test_parents_in_the_same_call_or_already_published_let_a_chunk_pass():
    a = Anchors(Counter())
    assert names(a.order([chunk(1, None), chunk(2, 1)], nothing)) == ["k1", "k2"]
    assert names(a.order([chunk(3, 2)], nothing)) == []  # k2 passed, but nothing says published
    assert names(a.order([chunk(5, 4)], lambda h: h == b"h4")) == ["k5"]


def test_a_parent_published_otherwise_frees_its_children_at_the_next_sweep(monkeypatch):
    monkeypatch.setattr(anchors_module, "SWEEP_EVERY_S", 0.0)
    a = Anchors(Counter())
    assert names(a.order([chunk(2, 1), chunk(3, 2)], nothing)) == []
    assert names(a.order([], lambda h: h == b"h1")) == ["k2", "k3"]


def test_a_chunk_gone_while_it_waits_is_forgotten_and_its_gone_passes():
    a = Anchors(Counter())
    a.order([chunk(2, 1)], nothing)
    assert names(a.order([gone(2)], nothing)) == ["k2 gone"]
    assert names(a.order([chunk(1, None)], nothing)) == ["k1"]  # k2 is not published


def test_a_chunk_named_again_while_it_waits_keeps_its_latest_naming():
    a = Anchors(Counter())
    a.order([chunk(2, 1)], nothing)
    again = Found(ChunkKey(b"k2"), chunk(2, 1).blocks, shared=False, remote=True)
    a.order([again], nothing)
    assert len(a) == 1
    assert a.order([chunk(1, None)], nothing)[1] == again


def test_past_the_limit_the_oldest_waiting_are_dropped_and_counted():
    counters = Counter()
    a = Anchors(counters, limit=2)
    a.order([chunk(2, 1), chunk(3, 1), chunk(4, 1)], nothing)
    assert counters["kv_events_dropped"] == 1 and len(a) == 2
    out = names(a.order([chunk(1, None)], nothing))
    assert out[0] == "k1" and sorted(out[1:]) == ["k3", "k4"]  # k2, the oldest, was dropped
