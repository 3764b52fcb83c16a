"""vLLM's cache reset (``reset_connector``: new weights loaded in place, a paused engine's
caches cleared): no chunk stored before is loaded again, in any tier or pool; requests in
flight at the reset neither load nor store; a prefill/decode split keeps handing off."""

from array import array
from collections import Counter

from kvtier.connector.common.messages import StepPlan
from kvtier.connector.scheduler.events import ChunkBlocks, KVEvents
from kvtier.connector.scheduler.handoff import EPOCH_BYTES, Handoff, Handoffs, Role
from kvtier.tiers.base import TierName
from tests.helpers.handoff_requests import DIGEST, NS
from tests.helpers.handoff_requests import request as handed_off
from tests.helpers.recorded_events import Recorded
from tests.helpers.scheduler_side import GEO, request, scheduler, store_all


def test_nothing_stored_before_a_reset_is_loaded_after_it(tmp_path):
    side = scheduler(disk=tmp_path)
    store_all(side, request("a", 64))
    assert side.num_new_matched_tokens(request("b", 65), 0)[0] == 64  # a hit before
    assert side.reset_cache() is True and side.counters["cache_resets"] == 1
    assert side.num_new_matched_tokens(request("c", 65), 0)[0] == 0  # the same tokens: a miss
    store_all(side, request("d", 64))  # computed again with the new weights, stored
    assert side.num_new_matched_tokens(request("e", 65), 0)[0] == 64
    assert len(side.stack.indexes[TierName.HOST]) == 4  # those of before stay till evicted


def test_a_request_in_flight_at_a_reset_neither_loads_nor_stores(tmp_path):
    side = scheduler(disk=tmp_path)
    store_all(side, request("a", 64))
    old = request("b", 97)
    assert side.num_new_matched_tokens(old, 0)[0] == 64
    side.reset_cache()
    assert side.num_new_matched_tokens(old, 0)[0] == 0  # asked again (preempted): its keys name
    meta = StepPlan()  # chunks of the weights before, and what vLLM holds of it was computed
    side.plan_stores(old, ([1, 2, 3, 4, 5, 6],), 96, meta)  # with them: nothing is stored
    assert meta.stores == []


def test_a_reset_makes_a_new_epoch_each_time():
    handoffs = Handoffs(Role.BOTH, NS, 1.0, Counter())
    assert handoffs.epoch == b""
    handoffs.reset()
    first = handoffs.epoch
    handoffs.reset()
    assert len(first) == len(handoffs.epoch) == EPOCH_BYTES and first != handoffs.epoch


def test_a_consumer_keys_a_handed_off_request_in_its_producers_epoch():
    producer, consumer = (Handoffs(role, NS, 1.0, Counter()) for role in (Role.PRODUCER, Role.CONSUMER))
    producer.reset()
    req = handed_off("r", 65, prompt=65)
    params = producer.params(req, 64)
    assert Handoff.of(params) == Handoff(64, DIGEST, producer.epoch.hex())
    assert consumer.epoch_of(handed_off("r", 65, params)) == producer.epoch
    assert consumer.epoch_of(handed_off("s", 65)) == b""  # no hand-off: its own
    both = Handoffs(Role.BOTH, NS, 1.0, Counter())  # an engine that stores keys in its own
    assert both.epoch_of(handed_off("r", 65, params)) == b""  # (a client's params pick none)
    for epoch in ("zz" * EPOCH_BYTES, "ab", 7):  # not an epoch: no hand-off
        assert Handoff.of({"kvtier": {"tokens": 3, "namespace": DIGEST, "epoch": epoch}}) is None


def test_a_reset_forgets_every_chunk_the_events_told():
    events = KVEvents(GEO, Recorded(), Counter())
    blocks = ChunkBlocks((b"h1", b"h2"), None, array("i", range(32)))
    events.found(b"k" * 16, blocks, shared=False, on_disk=True)
    assert events.take()
    events.clear()  # vLLM told the router every block is gone (AllBlocksCleared)
    events.removed(b"k" * 16, TierName.DISK)  # its eviction later
    events.shared_gone(b"k" * 16)
    assert events.take() == [] and len(events) == 0
