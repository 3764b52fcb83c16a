"""The KV events waiting for vLLM's takes (``event_backlog.py``, through ``KVEvents``): a
removal of a chunk the router was told of is never dropped, however many come at once (a
disk path taken out of service), a take hands over a bounded share, the rest follow in
order, and a chunk stored and removed between two takes is not told at all; stored again,
it goes before its children (and after its parent), and a chunk whose stored change was
dropped is told once stored again. A parent counts as published only while the router
holds it once the events waiting are taken."""

from collections import Counter

from kvtier.connector.scheduler.anchors import Anchors
from kvtier.connector.scheduler.event_backlog import EventBacklog
from kvtier.connector.scheduler.events import ChunkBlocks, KVEvents
from kvtier.connector.scheduler.storage_events import Found
from kvtier.connector.scheduler.tier_watch import WatchedIndex
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierName
from kvtier.tiers.policy import make_policy
from tests.helpers.event_router import Anchored, Chained, Factory, Router, chunk, prompt, recorded
from tests.helpers.scheduler_side import GEO


def test_every_removal_of_a_retired_path_reaches_the_router_a_share_per_take():
    counters: Counter = Counter()
    events = KVEvents(GEO, Factory(), counters, limit=1000)
    events.per_take = 700
    disk = WatchedIndex(3000, make_policy("lru"), TierName.DISK, events)
    router = Router()
    for n, key in enumerate(recorded(events, 3000)):
        disk.reserve(key)
        disk.commit(key)
        if n % 500 == 499:  # a take per step while they were written
            router.apply(events.take())
    while router.apply(events.take()):
        pass
    assert len(router.held) == 3000 and counters["kv_events_dropped"] == 0
    disk.retire(range(3000))  # the path is taken out of service: 3,000 removals at once
    sizes = []
    while size := router.apply(events.take()):
        sizes.append(size)
    assert sizes == [700, 700, 700, 700, 200]  # a share per take, the rest the next
    assert router.held == set() and counters["kv_events_dropped"] == 0
    assert len(events) == 0  # every record let go once its removal was handed over


def test_past_the_limit_stored_changes_are_dropped_never_removals():
    counters: Counter = Counter()
    events = KVEvents(GEO, Factory(), counters, limit=2)
    host = WatchedIndex(10, make_policy("lru"), TierName.HOST, events)
    router = Router()
    old = recorded(events, 3)
    for key in old:
        host.reserve(key)
        host.commit(key)
        router.apply(events.take())
    assert len(router.held) == 3
    for key in old:  # three removals, past the limit of two: every one kept
        host.discard(key)
    for key in recorded(events, 3, first=3):  # three stored past the limit of two
        host.reserve(key)
        host.commit(key)
    router.apply(events.take())
    assert router.held == {("CPU", False, chunk(i)[1].hashes[-1]) for i in (4, 5)}
    assert counters["kv_events_dropped"] == 1  # the oldest stored change, not a removal


def test_a_chunk_stored_and_removed_between_takes_is_not_told():
    counters: Counter = Counter()
    events = KVEvents(GEO, Factory(), counters)
    a, b = recorded(events, 2)
    events.stored(a, TierName.HOST)
    events.removed(a, TierName.HOST)  # gone before vLLM took anything: nothing to tell
    events.stored(b, TierName.HOST)
    assert [e[0] for e in events.take()] == ["stored"]
    events.removed(b, TierName.HOST)
    events.stored(b, TierName.HOST)  # back before the take: the router's view holds
    events.stored(a, TierName.HOST)
    assert [(e[0], e[3]) for e in events.take()] == [("stored", chunk(0)[1].hashes[-1])]


def test_the_backlog_hands_changes_over_in_the_order_they_came():
    backlog = EventBacklog(10, Counter())
    slots = [(ChunkKey(bytes([i]) * 16), "CPU", False) for i in range(4)]
    backlog.change(True, slots[0], "a")
    backlog.change(False, slots[1], "b")
    backlog.change(True, slots[2], "c")
    backlog.change(True, slots[0], "a")  # a repeat keeps its first place
    backlog.change(False, slots[3], "d")
    assert backlog.take(3) == [(True, slots[0], "a"), (False, slots[1], "b"),
                               (True, slots[2], "c")]
    assert backlog.take(3) == [(False, slots[3], "d")] and len(backlog) == 0


def test_a_chunk_stored_again_before_the_take_goes_before_its_children():
    """Parent stored, child stored, parent evicted and stored again, all before one take:
    the parent keeps its first place, so the router does not drop the child."""
    events = KVEvents(GEO, Chained(), Counter())
    host = WatchedIndex(10, make_policy("lru"), TierName.HOST, events)
    parent, child = prompt(events, 2)
    for key in (parent, child, parent):
        if key in host:
            host.discard(key)  # evicted before vLLM took anything
        host.reserve(key)
        host.commit(key)
    router = Anchored()
    router.apply(events.take())
    assert router.held == {("CPU", False, chunk(i)[1].hashes[-1]) for i in (0, 1)}


def test_a_take_passing_a_cancelled_place_keeps_it_for_the_chunk_stored_again():
    """A take that passes the place of a parent's stored change cancelled since, handing an
    unrelated chunk stored after it: the parent stored again still goes before its child."""
    events = KVEvents(GEO, Chained(), Counter())
    events.per_take = 1
    host = WatchedIndex(10, make_policy("lru"), TierName.HOST, events)
    (other,) = prompt(events, 1, first=5)
    parent, child = prompt(events, 2)
    for key in (parent, other, child):
        host.reserve(key)
        host.commit(key)
    host.discard(parent)
    router = Anchored()
    router.apply(events.take())  # past the parent's place, to the other chunk
    assert router.held == {("CPU", False, chunk(5)[1].hashes[-1])}
    prompt(events, 1)  # its record was let go at the take: planned for store, it is kept again
    host.reserve(parent)
    host.commit(parent)
    while router.apply(events.take()):
        pass
    assert router.held == {("CPU", False, chunk(i)[1].hashes[-1]) for i in (0, 1, 5)}


def test_the_places_kept_for_cancelled_changes_stay_bounded():
    """An engine vLLM takes nothing from while its host churns: each chunk stored and
    evicted keeps its place only while ``limit`` others do, and the stored changes
    waiting past ``limit`` are dropped, the oldest first."""
    counters: Counter = Counter()
    backlog = EventBacklog(4, counters)
    slots = [(ChunkKey(i.to_bytes(16, "big")), "CPU", False) for i in range(1000)]
    for n, slot in enumerate(slots):
        backlog.change(True, slot, n)
        if n % 100:  # evicted before any take, but one chunk of each hundred
            backlog.change(False, slot, n)
        assert len(backlog._cancelled) <= 4 and len(backlog._places) <= 3 * 4 + 1
    assert counters["kv_events_dropped"] == 7  # the oldest, each time a fifth came
    assert backlog.take(10) == [(True, slots[n], n) for n in (700, 800, 900)]


def test_a_chunk_whose_stored_change_was_dropped_is_told_when_stored_again():
    """Past the limit a chunk's stored change is dropped; its eviction then is not queued
    (the router never learnt it, and the removal would cancel the store that follows), so
    stored again, the chunk is told."""
    counters: Counter = Counter()
    events = KVEvents(GEO, Factory(), counters, limit=2)
    host = WatchedIndex(10, make_policy("lru"), TierName.HOST, events)
    router = Router()
    keys = recorded(events, 3)
    for key in keys:  # past the limit of two: the first one's stored change dropped
        host.reserve(key)
        host.commit(key)
    router.apply(events.take())
    host.discard(keys[0])
    host.reserve(keys[0])
    host.commit(keys[0])
    router.apply(events.take())
    assert counters["kv_events_dropped"] == 1
    assert router.held == {("CPU", False, chunk(i)[1].hashes[-1]) for i in range(3)}


def test_a_child_stored_again_follows_its_parent_stored_anew_after_a_take():
    """The router was told of the parent; in one step the child is stored and evicted (its
    place kept) and the parent evicted, its removal handed after that place; stored again,
    the parent takes a new place, and the child stored after it goes after it, not back to
    its kept place."""
    events = KVEvents(GEO, Chained(), Counter())
    host = WatchedIndex(10, make_policy("lru"), TierName.HOST, events)
    router = Anchored()
    parent, child = prompt(events, 2)
    host.reserve(parent)
    host.commit(parent)
    router.apply(events.take())
    host.reserve(child)
    host.commit(child)
    host.discard(child)  # its stored change cancelled, its place kept
    host.discard(parent)  # the removal waits after the child's place
    router.apply(events.take())
    assert router.held == set()
    prompt(events, 2)  # their records were let go at the take: planned for store again
    for key in (parent, child):
        host.reserve(key)
        host.commit(key)
    router.apply(events.take())
    assert router.held == {("CPU", False, chunk(i)[1].hashes[-1]) for i in (0, 1)}


def test_a_parent_is_published_only_while_the_router_holds_it_once_the_events_are_taken():
    """``published`` says whether a chunk queued now follows a stored event of its parent
    the router keeps: not when the parent's stored change was cancelled or dropped, or its
    removal waits."""
    events = KVEvents(GEO, Chained(), Counter(), limit=1)
    host = WatchedIndex(10, make_policy("lru"), TierName.HOST, events)
    a, b, c = prompt(events, 3)
    last = [chunk(i)[1].hashes[-1] for i in range(3)]
    host.reserve(a)
    host.commit(a)
    assert events.published(last[0])  # its stored change waits
    host.discard(a)
    assert not events.published(last[0])  # cancelled: the router is told nothing
    host.reserve(b)
    host.commit(b)
    host.reserve(c)
    host.commit(c)  # past the limit of one: b's stored change dropped
    assert not events.published(last[1]) and events.published(last[2])
    events.take()
    assert events.published(last[2])  # taken, held
    host.discard(c)
    assert not events.published(last[2])  # its removal waits


def test_a_child_named_by_the_remote_log_waits_for_a_parent_whose_store_was_cancelled():
    """The parent stored in host memory and evicted before the take (never told); the remote
    log names the child in that step: it waits rather than reach a router that drops it."""
    events = KVEvents(GEO, Chained(), Counter())
    host = WatchedIndex(10, make_policy("lru"), TierName.HOST, events)
    anchors, router = Anchors(Counter()), Anchored()
    (parent,) = prompt(events, 1)
    child, blocks = chunk(1)  # known only from the log
    named = ChunkBlocks(blocks.hashes, chunk(0)[1].hashes[-1], blocks.tokens)
    host.reserve(parent)
    host.commit(parent)
    host.discard(parent)
    anchors.order([Found(child, named, False, remote=True)],
                  lambda found: events.found_remote(found.key, found.blocks), events.published)
    router.apply(events.take())
    assert len(anchors) == 1 and router.held == set()


def test_a_child_stored_again_keeps_its_place_while_the_router_holds_its_parent():
    """The parent told in host memory, then written to disk after its children were stored:
    the child evicted and stored again takes its place back, ahead of its own child."""
    events = KVEvents(GEO, Chained(), Counter())
    host = WatchedIndex(10, make_policy("lru"), TierName.HOST, events)
    disk = WatchedIndex(10, make_policy("lru"), TierName.DISK, events)
    router = Anchored()
    parent, child, grandchild = prompt(events, 3)
    host.reserve(parent)
    host.commit(parent)
    router.apply(events.take())
    for index, key in ((host, child), (host, grandchild), (disk, parent), (host, child)):
        if key in index:
            index.discard(key)  # evicted before the take
        index.reserve(key)
        index.commit(key)
    router.apply(events.take())
    held = {("CPU", False, chunk(i)[1].hashes[-1]) for i in range(3)}
    assert router.held == held | {("STORAGE", False, chunk(0)[1].hashes[-1])}
