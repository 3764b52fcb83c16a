"""kvtier's KV events (``scheduler/events.py``, ``scheduler/tier_watch.py`` and
``connector.py``'s ``VllmEvents``): the same block hashes vLLM publishes, one event per tier
a chunk enters or leaves, a bounded queue, nothing while vLLM's events are off."""

from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import (
    resolve_block_hashes,
)
from vllm.v1.request import Request

from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import StepPlan, WorkerReport
from kvtier.connector.scheduler.events import MEDIUMS, KVEvents, chunk_blocks
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.vllm_events import VllmEvents, event_factory
from kvtier.tiers.base import TierName
from tests.helpers.vllm_requests import vllm_chain as chain_of
from tests.helpers.vllm_requests import vllm_request as make_request

BLOCK, CHUNK = 16, 32
HASHING = SimpleNamespace(prefix_caching_hash_algo="sha256")  # vLLM's default


def geometry(hash_block: int = BLOCK) -> KVGeometry:
    return KVGeometry(num_layers=2, page_bytes=4096, block_tokens=BLOCK,
                      hash_block_tokens=hash_block, chunk_tokens=CHUNK, kv_dtype="bfloat16",
                      page_shape="t")


def vllm_request(name: str, tokens: list[int], hash_block: int = BLOCK,
                 salt: str | None = None) -> Request:
    """A request as vLLM's scheduler sees it, its block hashes made by vLLM (sha256)."""
    return make_request(name, tokens, BLOCK, hash_block, salt)


def vllm_chain(tokens: list[int]) -> list[bytes]:
    """vLLM's hash of each full block of ``BLOCK`` tokens, chained by parent hash."""
    return chain_of(tokens, BLOCK)


TOKENS = list(range(1000, 1100))  # 6 full blocks, 3 full chunks


@pytest.mark.parametrize("hash_block", [BLOCK, BLOCK // 2])
def test_a_chunk_names_its_blocks_by_vllms_chained_hashes(hash_block):
    req = vllm_request("r", TOKENS, hash_block)
    # what vLLM's block pool publishes for its GPU blocks of BLOCK tokens
    chain = list(resolve_block_hashes(req.block_hashes, hash_block, BLOCK))[:6]
    if hash_block == BLOCK:
        assert chain == vllm_chain(TOKENS)
    for chunk in range(3):
        blocks = chunk_blocks(req, geometry(hash_block), chunk)
        assert blocks is not None
        assert list(blocks.hashes) == chain[2 * chunk:2 * chunk + 2]
        assert blocks.parent == (chain[2 * chunk - 1] if chunk else None)
        assert blocks.tokens.tolist() == TOKENS[CHUNK * chunk:CHUNK * (chunk + 1)]
    assert chunk_blocks(req, geometry(hash_block), 3) is None  # 4 tokens: not hashed yet


class Made:
    """A stand-in for ``VllmEvents``: what each event said."""

    def extra_keys(self, request, start, stop):
        return None

    def stored(self, blocks, medium):
        return [("stored", medium, blocks.hashes)]

    def removed(self, blocks, medium):
        return [("removed", medium, blocks.hashes)]


def side_with_events(tmp_path=None, host_chunks=4, factory=None) -> SchedulerSide:
    cfg = {"chunk_tokens": CHUNK, "host_capacity": host_chunks * geometry().chunk_bytes,
           "load_policy": "always"}
    if tmp_path is not None:
        cfg.update(disk_paths=[str(tmp_path)], disk_capacity=8 * (4096 + geometry().chunk_bytes))
    return SchedulerSide(load_config(cfg, environ={}), geometry(),
                         [geometry().namespace("m", "", 1, 0)], 1, factory or Made())


def store(side: SchedulerSide, req: Request, disk_ok: bool = True) -> StepPlan:
    meta = StepPlan()
    side.plan_stores(req, (list(range(100, 100 + req.num_tokens // BLOCK)),), req.num_tokens,
                     meta)
    side.worker_report(WorkerReport(host_stored=Counter({s.key: 1 for s in meta.stores})))
    written = Counter({s.key: 1 for s in meta.stores if s.disk_slot is not None})
    side.worker_report(WorkerReport(disk_written=written) if disk_ok
                       else WorkerReport(disk_failed=written))
    return meta


def test_each_chunk_is_published_as_it_reaches_host_memory_then_disk(tmp_path):
    side = side_with_events(tmp_path)
    req = vllm_request("a", TOKENS[:64])
    chain = vllm_chain(TOKENS[:64])
    meta = StepPlan()
    side.plan_stores(req, (list(range(100, 104)),), 64, meta)
    assert side.take_events() == []  # planned, not stored yet
    side.worker_report(WorkerReport(host_stored=Counter({s.key: 1 for s in meta.stores})))
    assert sorted(side.take_events()) == sorted([("stored", "CPU", tuple(chain[0:2])),
                                                 ("stored", "CPU", tuple(chain[2:4]))])
    side.worker_report(WorkerReport(disk_written=Counter({s.key: 1 for s in meta.stores})))
    assert sorted(side.take_events()) == sorted([("stored", "STORAGE", tuple(chain[0:2])),
                                                 ("stored", "STORAGE", tuple(chain[2:4]))])
    assert side.take_events() == []
    assert side.counters["kv_events"] == 4


def test_a_chunk_evicted_from_host_memory_is_removed_there_and_forgotten_when_gone():
    side = side_with_events(host_chunks=2)
    first, second = vllm_request("a", TOKENS[:64]), vllm_request("b", TOKENS[36:100])
    store(side, first)
    side.take_events()
    store(side, second)  # two new chunks evict both of the first request's
    events = side.take_events()
    removed = [e for e in events if e[0] == "removed"]
    assert [e[1] for e in removed] == ["CPU", "CPU"]
    assert {e[2] for e in removed} == {tuple(vllm_chain(TOKENS[:64])[i:i + 2]) for i in (0, 2)}
    assert side.events is not None and len(side.events) == 2  # only the chunks still held


def test_a_failed_store_and_a_failed_disk_write_publish_nothing(tmp_path):
    side = side_with_events(tmp_path)
    meta = StepPlan()
    side.plan_stores(vllm_request("a", TOKENS[:32]), ([100, 101],), 32, meta)
    side.worker_report(WorkerReport(host_failed=Counter({s.key: 1 for s in meta.stores}),
                                    disk_failed=Counter({s.key: 1 for s in meta.stores})))
    assert side.take_events() == []
    assert side.events is not None and len(side.events) == 0
    store(side, vllm_request("b", TOKENS[:32]), disk_ok=False)
    assert [e[1] for e in side.take_events()] == ["CPU"]


def test_a_discarded_chunk_and_a_retired_disk_path_are_removed(tmp_path):
    side = side_with_events(tmp_path)
    meta = store(side, vllm_request("a", TOKENS[:64]))
    side.take_events()
    side.stack.discard(meta.stores[0].key)  # a failed checksum drops it from every tier
    assert sorted(e[1] for e in side.take_events()) == ["CPU", "STORAGE"]
    side.worker_report(WorkerReport(paths_down=Counter({0: 1})))
    assert [e[:2] for e in side.take_events()] == [("removed", "STORAGE")]


def test_a_disk_write_that_ends_after_its_path_went_down_is_not_published(tmp_path):
    """A write job already running when its path went out of service ends well: the chunk
    is not made visible on the retired slot nor published on disk (it was published, and
    never removed once that entry fell out). Found by a review."""
    side = side_with_events(tmp_path)
    meta = StepPlan()
    side.plan_stores(vllm_request("a", TOKENS[:32]), ([100, 101],), 32, meta)
    (chunk,) = meta.stores
    side.worker_report(WorkerReport(host_stored=Counter({chunk.key: 1})))
    assert [e[:2] for e in side.take_events()] == [("stored", "CPU")]
    side.worker_report(WorkerReport(paths_down=Counter({0: 1})))
    side.worker_report(WorkerReport(disk_written=Counter({chunk.key: 1})))
    assert side.take_events() == []
    assert side.stack.locate(chunk.key).tier is TierName.HOST
    assert side.counters["disk_failed_chunks"] == 1 and side.counters["disk_written_chunks"] == 0
    side.stack.discard(chunk.key)
    assert [e[:2] for e in side.take_events()] == [("removed", "CPU")]
    assert len(side.events) == 0  # its record let go


def test_the_queue_is_bounded_dropping_the_oldest():
    counters: Counter = Counter()
    events = KVEvents(geometry(), Made(), counters, limit=2)
    keys = [bytes([i]) * 16 for i in range(3)]
    for i, key in enumerate(keys):
        events.record(key, vllm_request(f"r{i}", TOKENS[i:i + 32]), 0)  # type: ignore[arg-type]
        events.stored(key, TierName.HOST)  # type: ignore[arg-type]
    taken = events.take()
    assert [e[2] for e in taken] == [chunk_blocks(vllm_request(f"r{i}", TOKENS[i:i + 32]),
                                                  geometry(), 0).hashes for i in (1, 2)]
    assert counters["kv_events_dropped"] == 1 and counters["kv_events"] == 2


def test_nothing_is_recorded_or_published_while_vllms_events_are_off():
    groups = SimpleNamespace(kv_cache_groups=[])
    for off in (SimpleNamespace(kv_events_config=None),
                SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=False))):
        assert event_factory(off, groups, BLOCK) is None
    on = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True),
                         cache_config=HASHING)
    assert isinstance(event_factory(on, groups, BLOCK), VllmEvents)
    cfg = load_config({"chunk_tokens": CHUNK, "host_capacity": 4 * geometry().chunk_bytes},
                      environ={})
    side = SchedulerSide(cfg, geometry(), [geometry().namespace("m", "", 1, 0)], 1)
    store(side, vllm_request("a", TOKENS[:64]))
    assert side.events is None and side.take_events() == []


def test_vllm_events_carry_the_medium_the_group_and_vllms_hash_form(monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")  # hashes as bytes
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype="float32")
    factory = VllmEvents(SimpleNamespace(cache_config=HASHING),
                         SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)]),
                         BLOCK)
    blocks = chunk_blocks(vllm_request("a", TOKENS[:64]), geometry(), 1)
    assert blocks is not None
    (stored,) = factory.stored(blocks, MEDIUMS[TierName.DISK])
    chain = vllm_chain(TOKENS[:64])
    assert isinstance(stored, BlockStored) and stored.medium == MEDIUM_STORAGE
    assert (stored.block_hashes, stored.parent_block_hash) == (chain[2:4], chain[1])
    assert (stored.token_ids, stored.block_size, stored.group_idx) == (TOKENS[32:64], BLOCK, 0)
    assert (stored.kv_cache_spec_kind, stored.locality) == ("full_attention", "LOCAL")
    (removed,) = factory.removed(blocks, MEDIUMS[TierName.HOST])
    assert isinstance(removed, BlockRemoved) and removed.medium == MEDIUM_CPU
    assert (stored.locality, stored.ownership) == ("LOCAL", None)
    (held,) = factory.stored(blocks, MEDIUM_STORAGE, remote=True)  # the remote store's
    (gone,) = factory.removed(blocks, MEDIUM_STORAGE, remote=True)
    assert {(e.locality, e.ownership) for e in (held, gone)} == {("REMOTE", "kvtier")}
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")  # vLLM's default: 64-bit ints
    (stored,) = factory.stored(blocks, MEDIUM_CPU)
    assert stored.block_hashes == [int.from_bytes(h, "big") & (2**64 - 1) for h in chain[2:4]]


def test_write_back_publishes_a_host_victim_on_disk_once_its_demotion_is_written(tmp_path):
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 2 * geometry().chunk_bytes,
           "load_policy": "always", "write_policy": "write_back", "disk_paths": [str(tmp_path)],
           "disk_capacity": 8 * (4096 + geometry().chunk_bytes)}
    side = SchedulerSide(load_config(cfg, environ={}), geometry(),
                         [geometry().namespace("m", "", 1, 0)], 1, Made())
    store(side, vllm_request("a", TOKENS[:64]))
    assert [e[1] for e in side.take_events()] == ["CPU", "CPU"]  # nothing on disk yet
    meta = StepPlan()
    side.plan_stores(vllm_request("b", TOKENS[36:100]), ([1, 2, 3, 4],), 64, meta)
    assert len(meta.demotions) == 2
    removed = side.take_events()
    assert sorted(e[:2] for e in removed) == [("removed", "CPU")] * 2  # evicted, writing
    side.worker_report(WorkerReport(disk_written=Counter({d.key: 1 for d in meta.demotions})))
    first = {tuple(vllm_chain(TOKENS[:64])[i:i + 2]) for i in (0, 2)}
    assert {e[2] for e in side.take_events() if e[1] == "STORAGE"} == first


def test_a_salted_prompts_first_block_carries_its_salt_as_vllms_events_do():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype="float32")
    factory = VllmEvents(SimpleNamespace(cache_config=HASHING),
                         SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)]),
                         BLOCK)
    salted = vllm_request("a", TOKENS[:64], salt="tenant-b")
    first = chunk_blocks(salted, geometry(), 0, factory.extra_keys)
    second = chunk_blocks(salted, geometry(), 1, factory.extra_keys)
    assert first is not None and second is not None
    assert first.extra_keys == (("tenant-b",), None) and second.extra_keys is None
    assert first.hashes[0] != vllm_chain(TOKENS[:64])[0]  # vLLM hashed the salt in
    (stored,) = factory.stored(first, MEDIUM_CPU)
    assert stored.extra_keys == [("tenant-b",), None]
    assert factory.stored(second, MEDIUM_CPU)[0].extra_keys is None


def test_a_chunk_found_on_disk_at_start_is_published_once_its_tokens_come(tmp_path):
    side = side_with_events(tmp_path)
    req = vllm_request("a", TOKENS[:64])
    first = side.chunk_keys(req, 1)[0]
    side.stack.indexes[TierName.DISK].adopt(first, 0)  # as recovered from the disk's index
    assert side.take_events() == []
    store(side, req)
    chain = vllm_chain(TOKENS[:64])
    assert sorted(side.take_events()) == sorted([
        ("stored", "STORAGE", tuple(chain[0:2])),  # already there, known now
        ("stored", "CPU", tuple(chain[2:4])), ("stored", "STORAGE", tuple(chain[2:4]))])
    store(side, vllm_request("b", TOKENS[:64]))
    assert side.take_events() == []  # known already: nothing new
