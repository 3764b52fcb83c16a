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


def chunk(n: int, parent: int | None, shared: bool = True, remote: bool = False) -> Found:
    """Chunk ``n`` (its blocks end with hash n) after chunk ``parent``."""
    blocks = ChunkBlocks((b"h%d-0" % n, b"h%d" % n), None if parent is None else b"h%d" % parent,
                         array("i", [n]))
    return Found(ChunkKey(b"k%d" % n), blocks, shared=shared, remote=remote)


def gone(n: int, shared: bool = True, remote: bool = False) -> Found:
    return Found(ChunkKey(b"k%d" % n), None, shared=shared, remote=remote)


class Feed:
    """What ``EventFeed`` does with what passes: a chunk handed on is published (its last
    block hash then ``published``), unless it is ``silent`` (a chunk of this engine's disk
    evicted meanwhile publishes nothing); ``already``: published before."""

    def __init__(self, already: set[bytes] = frozenset(), silent: set[int] = frozenset()):
        self.hashes, self.silent = set(already), silent
        self.out: list[Found] = []

    def order(self, anchors: Anchors, found: list[Found]) -> list[str]:
        self.out = []
        anchors.order(found, self.publish, self.hashes.__contains__)
        return [f.key.decode() + ("" if f.blocks else " gone") for f in self.out]

    def publish(self, found: Found) -> None:
        self.out.append(found)
        if found.blocks is not None and int(found.key[1:]) not in self.silent:
            self.hashes.add(found.blocks.hashes[-1])


def test_a_chunk_waits_for_its_parent_then_follows_it_with_its_own_children():
    a, feed = Anchors(Counter()), Feed()
    assert feed.order(a, [chunk(3, 2), chunk(2, 1)]) == []
    assert len(a) == 2
    assert feed.order(a, [chunk(1, None)]) == ["k1", "k2", "k3"]
    assert len(a) == 0


def test_parents_in_the_same_call_or_already_published_let_a_chunk_pass():
    a, feed = Anchors(Counter()), Feed(already={b"h4"})
    assert feed.order(a, [chunk(1, None), chunk(2, 1)]) == ["k1", "k2"]
    assert feed.order(a, [chunk(3, 2)]) == ["k3"]  # k2 was published by the call before
    assert feed.order(a, [chunk(5, 4)]) == ["k5"]


def test_a_child_waits_on_after_a_parent_that_published_nothing():
    """A chunk of this engine's disk evicted between the listing and its naming publishes
    nothing: its children must not go out unanchored (the router would drop them)."""
    a, feed = Anchors(Counter()), Feed(silent={1})
    assert feed.order(a, [chunk(2, 1)]) == []
    assert feed.order(a, [chunk(1, None, shared=False)]) == ["k1"]
    assert len(a) == 1  # k2 still waits, for a store of k1 or its naming by another holder
    assert feed.order(a, [chunk(1, None, shared=True)]) == ["k1"]  # k1 silent again
    feed.silent = set()
    assert feed.order(a, [chunk(1, None, shared=True)]) == ["k1", "k2"]


def test_a_parent_published_otherwise_frees_its_children_at_the_next_sweep(monkeypatch):
    monkeypatch.setattr(anchors_module, "SWEEP_EVERY_S", 0.0)
    a, feed = Anchors(Counter()), Feed()
    assert feed.order(a, [chunk(2, 1), chunk(3, 2)]) == []
    feed.hashes.add(b"h1")  # k1 stored by a request
    assert feed.order(a, []) == ["k2", "k3"]


def test_a_chunk_gone_while_it_waits_is_forgotten_and_its_gone_passes():
    a, feed = Anchors(Counter()), Feed()
    feed.order(a, [chunk(2, 1)])
    assert feed.order(a, [gone(2)]) == ["k2 gone"]
    assert feed.order(a, [chunk(1, None)]) == ["k1"]  # k2 is not published


def test_one_holders_naming_and_loss_leave_anothers_waiting_naming_alone():
    """A chunk in another engine's segment and in the remote store waits once per holder:
    each is published when its parent is, and a loss cancels only its own holder's."""
    a, feed = Anchors(Counter()), Feed()
    in_segment, in_store = chunk(2, 1), chunk(2, 1, shared=False, remote=True)
    feed.order(a, [in_segment, in_store])
    assert len(a) == 2
    assert feed.order(a, [gone(2, shared=False, remote=True)]) == ["k2 gone"]
    assert len(a) == 1
    feed.order(a, [in_store])
    assert feed.order(a, [chunk(1, None)]) == ["k1", "k2", "k2"]
    assert {(f.shared, f.remote) for f in feed.out[1:]} == {(True, False), (False, True)}


def test_a_holders_chunk_named_again_while_it_waits_keeps_its_latest_naming():
    a, feed = Anchors(Counter()), Feed()
    feed.order(a, [chunk(2, 1)])
    again = Found(ChunkKey(b"k2"), chunk(2, 7).blocks, shared=True)  # named anew by its writer
    feed.order(a, [again])
    assert len(a) == 1
    assert feed.order(a, [chunk(7, None)]) == ["k7", "k2"]
    assert feed.out[1] is again


def test_past_the_limit_the_oldest_waiting_are_dropped_and_counted():
    counters = Counter()
    a, feed = Anchors(counters, limit=2), Feed()
    feed.order(a, [chunk(2, 1), chunk(3, 1), chunk(4, 1)])
    assert counters["kv_events_dropped"] == 1 and len(a) == 2
    out = feed.order(a, [chunk(1, None)])
    assert out[0] == "k1" and sorted(out[1:]) == ["k3", "k4"]  # k2, the oldest, was dropped
