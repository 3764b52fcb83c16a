"""After vLLM cleared its GPU cache alone (a plain ``reset_prefix_cache``), a router forgets
every block of the engine, kvtier's too: each chunk the router had been told of and the
tiers still hold, or whose stored change waited, is told again (``event_retell.py``,
``KVEvents.router_cleared``), after its ancestors, a share per take; one stored meanwhile
follows its parent, one removed meanwhile is not told. vLLM's ``AllBlocksCleared`` is seen
in its block pool's queue (``GpuClears``), and an idle engine steps until every chunk is
told again."""

from collections import Counter
from types import SimpleNamespace

import pytest

from kvtier.config.settings import load_config
from kvtier.connector.scheduler.event_retell import Retell
from kvtier.connector.scheduler.events import ChunkBlocks, KVEvents
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.scheduler.tier_watch import WatchedIndex
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierName
from kvtier.tiers.policy import make_policy
from tests.helpers.event_router import Anchored, Chained, chunk, prompt
from tests.helpers.scheduler_side import CHUNK, GEO


def last(i: int) -> bytes:
    return chunk(i)[1].hashes[-1]


def tiers(events: KVEvents) -> tuple[WatchedIndex, WatchedIndex]:
    return (WatchedIndex(100, make_policy("lru"), TierName.HOST, events),
            WatchedIndex(100, make_policy("lru"), TierName.DISK, events))


def put(index: WatchedIndex, *keys: ChunkKey) -> None:
    for key in keys:
        index.reserve(key)
        index.commit(key)


def side_with_events() -> SchedulerSide:
    """A scheduler side with KV events on (``Chained``'s stand-ins for vLLM's)."""
    cfg = load_config({"chunk_tokens": CHUNK, "host_capacity": 4 * GEO.chunk_bytes}, environ={})
    side = SchedulerSide(cfg, GEO, [GEO.namespace("m", "", 1, 0)], 1, Chained())
    assert side.events is not None
    return side


def drain(events: KVEvents, router: Anchored) -> list[int]:
    sizes = []
    while size := router.apply(events.take()):
        sizes.append(size)
    return sizes


def test_every_chunk_held_is_told_again_after_the_router_forgot_them_a_parent_first():
    counters: Counter = Counter()
    events = KVEvents(GEO, Chained(), counters)
    events.per_take = 4
    host, disk = tiers(events)
    router = Anchored()
    keys = prompt(events, 6)
    put(host, *keys)
    put(disk, *keys[:3])
    drain(events, router)
    held = ({("CPU", False, last(i)) for i in range(6)}
            | {("STORAGE", False, last(i)) for i in range(3)})
    assert router.held == held
    host.discard(keys[5])  # its removal waits when the router forgets all
    router.held.clear()  # vLLM's AllBlocksCleared, handed over before the events waiting
    events.router_cleared()
    assert events.retelling and counters["kv_events_retold"] == 8
    assert drain(events, router) == [4, 4]  # a share per take; the removal not handed
    assert router.held == held - {("CPU", False, last(5))}  # the Anchored router kept each
    assert not events.retelling


def test_a_chunk_stored_meanwhile_follows_its_parent_told_first():
    events = KVEvents(GEO, Chained(), Counter())
    events.per_take = 1
    host, _ = tiers(events)
    router = Anchored()
    keys = prompt(events, 4)
    put(host, *keys[:3])
    drain(events, router)
    router.held.clear()
    events.router_cleared()
    put(host, keys[3])  # its parent, grandparent and root wait to be told again
    drain(events, router)
    assert router.held == {("CPU", False, last(i)) for i in range(4)}


def test_a_chunk_removed_before_it_was_told_again_is_not_told():
    events = KVEvents(GEO, Chained(), Counter())
    host, _ = tiers(events)
    router = Anchored()
    (root, child) = prompt(events, 2)
    put(host, root, child)
    drain(events, router)
    router.held.clear()
    events.router_cleared()
    host.discard(child)
    taken = events.take()
    assert [(e[0], e[3]) for e in taken] == [("stored", last(0))]  # no removal of the child
    assert len(events) == 1  # the child's record let go


def test_a_second_clear_before_the_first_was_told_tells_both_once():
    counters: Counter = Counter()
    events = KVEvents(GEO, Chained(), counters)
    events.per_take = 2
    host, _ = tiers(events)
    router = Anchored()
    keys = prompt(events, 5)
    put(host, *keys)
    drain(events, router)
    router.held.clear()
    events.router_cleared()
    router.apply(events.take())  # two told again
    router.held.clear()
    events.router_cleared()  # those two again, the three still waiting kept
    assert drain(events, router) == [2, 2, 1]
    assert router.held == {("CPU", False, last(i)) for i in range(5)}


def test_nothing_is_told_again_after_a_reset_of_kvtiers_cache_too():
    """``reset_connector``: kvtier's events forgot every chunk first (``KVEvents.clear``)."""
    events = KVEvents(GEO, Chained(), Counter())
    host, _ = tiers(events)
    put(host, *prompt(events, 2))
    events.take()
    events.clear()
    events.router_cleared()
    assert not events.retelling and events.take() == []


def test_the_slots_waiting_are_returned_each_once_and_wait_till_dropped():
    retell = Retell([("CPU", False), ("STORAGE", False)])
    a, b, c, d = [(ChunkKey(bytes([n]) * 16), "CPU", False) for n in range(4)]
    retell.add({a, b, c})
    got = retell.next(2)
    assert len(got) == 2 and len(retell) == 3  # waiting till dropped
    assert all(retell.drop(slot) for slot in got) and not retell.drop(got[0])
    (left,) = {a, b, c} - set(got)
    assert retell.drop(left)  # told with a child before its turn, say
    assert retell.next(5) == []  # dropped: not returned
    retell.add({got[0], d})
    retell.add({got[0], c})  # a second clear while some wait: each kept once
    assert len(retell) == len({got[0], c, d}) and retell.of(d[0]) == [d]
    rest = retell.next(5)
    assert sorted(rest) == sorted({got[0], c, d}) and retell.next(5) == []
    assert all(retell.drop(slot) for slot in rest) and len(retell) == 0


def test_a_child_waiting_when_the_router_forgot_all_goes_after_its_parent_told_again():
    """The child's stored change waited (its parent told) when the router forgot every
    block: it is told anew after its parent, not first (a router drops it then)."""
    events = KVEvents(GEO, Chained(), Counter())
    events.per_take = 1
    host, _ = tiers(events)
    router = Anchored()
    keys = prompt(events, 3)
    put(host, keys[0])
    drain(events, router)
    put(host, keys[1], keys[2])  # both wait, the router holding their parent
    router.held.clear()
    events.router_cleared()
    drain(events, router)
    assert router.held == {("CPU", False, last(i)) for i in range(3)}


def test_a_chunk_named_from_its_record_is_not_held_back_by_a_parent_waiting_to_be_told():
    """A parent waiting to be told again counts as published: a chunk named under it goes
    now, its parent told first, rather than wait for it (and be dropped past a bound)."""
    events = KVEvents(GEO, Chained(), Counter())
    host, _ = tiers(events)
    router = Anchored()
    (parent,) = prompt(events, 1)
    put(host, parent)
    drain(events, router)
    router.held.clear()
    events.router_cleared()
    assert events.published(last(0))
    child, blocks = chunk(1)
    events.found(child, ChunkBlocks(blocks.hashes, last(0), blocks.tokens), shared=False,
                 on_disk=True)
    events.per_take = 1
    drain(events, router)
    assert router.held == {("CPU", False, last(0)), ("STORAGE", False, last(1))}


def pool(*queue) -> SimpleNamespace:
    return SimpleNamespace(kv_event_queue=list(queue))


def test_vllms_clear_is_seen_once_in_its_block_pools_queue():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    from kvtier.connector.vllm_events import GpuClears

    clears = GpuClears()
    other = BlockRemoved(block_hashes=[], medium="GPU")
    assert not clears.look(pool()) and not clears.look(pool(other))
    first = AllBlocksCleared()
    assert clears.look(pool(other, first, other))
    assert not clears.look(pool(other, first))  # the same, not taken yet: seen already
    assert clears.look(pool(first, AllBlocksCleared()))  # another reset before the take
    assert not clears.look(SimpleNamespace())  # a pool without events


def test_an_idle_engine_steps_while_chunks_wait_to_be_told_again():
    side = side_with_events()
    side.events.per_take = 2
    for key in prompt(side.events, 3):
        side.events.stored(key, TierName.HOST)
    side.take_events()
    side.take_events()
    assert not side.has_pending_push_work()
    side.events.router_cleared()
    steps = 0
    while side.has_pending_push_work() and steps < 10:  # vLLM steps the idle engine
        steps += 1
        side.take_events()
    assert steps == 2


@pytest.mark.parametrize("vllm_cleared", [True, False])
def test_kvtiers_reset_tells_the_removals_where_vllms_own_reset_failed(vllm_cleared):
    """vLLM resets the connector (``reset_connector``) even when its own reset failed (blocks
    in use): no ``AllBlocksCleared`` then, so the router is told each removal instead of
    crediting chunks this engine never loads again."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import AllBlocksCleared

    from kvtier.connector.connector import KVTierConnector
    from kvtier.connector.vllm_events import GpuClears

    side = side_with_events()
    keys = prompt(side.events, 3)
    for key in keys:
        side.events.stored(key, TierName.HOST)
    assert len(side.take_events()) == 3
    side.events.stored(keys[2], TierName.DISK)  # waiting: never told, nothing to remove
    connector = KVTierConnector.__new__(KVTierConnector)  # its scheduler side alone
    queue = pool(AllBlocksCleared()) if vllm_cleared else pool()
    connector._scheduler, connector._clears = side, GpuClears()
    connector._kv_cache_manager = SimpleNamespace(block_pool=queue)
    assert connector.reset_cache() is True
    taken = side.take_events()
    if vllm_cleared:
        assert taken == []
    else:
        assert sorted((e[0], e[1], e[3]) for e in taken) == \
            sorted(("removed", "CPU", last(i)) for i in range(3))
    assert side.take_events() == [] and len(side.events) == 0


def test_a_removal_still_waiting_at_a_failed_vllm_reset_is_told():
    """The chunk's record was let go at a take while its removal waited behind a burst of
    stores: the removal, told after kvtier's reset, names it from its waiting change."""
    events = KVEvents(GEO, Chained(), Counter())
    events.per_take = 2
    host, _ = tiers(events)
    router = Anchored()
    first, *others = prompt(events, 5)
    put(host, first)
    drain(events, router)
    put(host, *others)  # more than a take
    host.discard(first)  # its removal waits behind them; its record goes at the next take
    router.apply(events.take())
    events.clear(router_told=False)  # vLLM's own reset failed: no AllBlocksCleared
    drain(events, router)
    assert router.held == set()


def test_an_idle_engine_steps_until_the_removals_of_a_failed_reset_are_told():
    side = side_with_events()
    side.events.per_take = 2
    for key in prompt(side.events, 5):
        side.events.stored(key, TierName.HOST)
    while side.take_events():
        pass
    side.reset_cache(router_told=False)  # five removals, two a take
    steps = 0
    while side.has_pending_push_work() and steps < 10:
        steps += 1
        side.take_events()
    assert steps == 3 and side.take_events() == []
