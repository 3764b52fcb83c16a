"""Hybrid models (several KV cache groups): the geometry read from vLLM's config, pages copied
group by group with vLLM's null block skipped, and the scheduler side's plans."""


import pytest
import torch

from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry, geometry_from_vllm
from kvtier.connector.common.messages import NULL_BLOCK, StepPlan, WorkerReport, chunk_blocks
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.worker.ledger import WorkerLedger
from kvtier.connector.worker.pages import PagedKV
from kvtier.errors import ConfigError
from kvtier.tiers.host import HostTier
from tests.helpers.scheduler_side import Request, request
from tests.helpers.vllm_specs import BLOCK, CHUNK, CONFIG, full, sliding, vllm_configs

spec_types = pytest.importorskip("vllm.v1.kv_cache_interface")


def test_a_hybrid_model_has_every_group_in_chunk_order():
    geo = geometry_from_vllm(*vllm_configs(sliding(), full()), CONFIG)
    assert geo.groups == (2, 2) and geo.num_layers == 4
    assert geo.layer_names == ("layers.0.0", "layers.0.1", "layers.1.0", "layers.1.1")
    assert geo.group_kinds == ("sliding64", "full")
    assert geo.chunk_bytes == 4 * 2 * full().page_size_bytes
    layout = geo.namespace("m", "", 1, 0).layout
    assert layout.endswith(":2sliding64+2full")
    other = geometry_from_vllm(*vllm_configs(sliding(window=128), full()), CONFIG)
    assert other.namespace("m", "", 1, 0) != geo.namespace("m", "", 1, 0)  # never a wrong hit


def test_a_one_group_model_keeps_its_namespace():
    geo = geometry_from_vllm(*vllm_configs(full()), CONFIG)
    assert geo.groups == (2,) and geo.group_kinds == ("full",)
    assert geo.namespace("m", "", 1, 0).layout == f"vllm-pages:2x{BLOCK}x2x64xbfloat16"


def test_loads_fail_whole_where_vllm_cannot_recompute_from_a_block():
    """Several groups (block ids not unique) or a sliding window (recomputing from a failed
    block needs the window before it, which the load skipped): the request is recomputed."""
    assert not geometry_from_vllm(*vllm_configs(full()), CONFIG).loads_whole
    assert geometry_from_vllm(*vllm_configs(sliding()), CONFIG).loads_whole
    assert geometry_from_vllm(*vllm_configs(sliding(), full()), CONFIG).loads_whole


def test_pages_packed_otherwise_never_share_a_namespace():
    """Padding, another packing of the same shape, or another fp8 format: other page bytes."""
    def layout(*specs, **kw):
        return geometry_from_vllm(*vllm_configs(*specs, **kw), CONFIG).namespace("m", "", 1, 0)

    plain = layout(full())
    padded = spec_types.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                          dtype=torch.bfloat16,
                                          page_size_padded=2 * full().page_size_bytes)
    assert layout(padded) != plain
    assert layout(full(), cache_dtype="fp8_e4m3") != layout(full(), cache_dtype="fp8_e5m2")
    assert layout(full(), cache_dtype="fp8_e4m3") != plain


def test_groups_kvtier_cannot_store_are_refused_with_the_group_named():
    mamba = spec_types.MambaSpec(block_size=BLOCK, shapes=((4, 64),), dtypes=(torch.float32,))
    with pytest.raises(ConfigError, match=r"group 1 of tiny-gemma .*layers\.1\.0.*MambaSpec"):
        geometry_from_vllm(*vllm_configs(full(), mamba), CONFIG)
    with pytest.raises(ConfigError, match="different block sizes or page sizes"):
        geometry_from_vllm(*vllm_configs(full(), sliding(block=32)), CONFIG)
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        geometry_from_vllm(*vllm_configs(full(), pp=2), CONFIG)


def test_context_parallelism_is_refused_with_the_setting_named():
    """Decode context parallelism makes a block span ``block_size x dcp`` tokens (vLLM's
    ``resolve_dcp_kv_block_size``), each rank keeping a share: chunks would map onto the
    wrong blocks. Prefill context parallelism adds workers per tensor-parallel rank."""
    with pytest.raises(ConfigError, match=r"decode_context_parallel_size = 2\) is not "
                                          r"supported: a block then spans 2 x block_size"):
        geometry_from_vllm(*vllm_configs(full(), dcp=2), CONFIG)
    with pytest.raises(ConfigError, match=r"prefill_context_parallel_size = 2\) is not supported"):
        geometry_from_vllm(*vllm_configs(full(), pcp=2), CONFIG)
    assert geometry_from_vllm(*vllm_configs(full(), dcp=1, pcp=1), CONFIG).block_tokens == BLOCK


LAYERS, BLOCKS, HIDDEN = 4, 12, 8
GEO = KVGeometry(LAYERS, 2 * BLOCK * HIDDEN * 2, BLOCK, BLOCK, 2 * BLOCK, "bfloat16", "t",
                 group_layers=(2, 2), layer_names=(), group_kinds=("sliding32", "full"))


def test_pages_move_group_by_group_and_the_null_block_is_skipped():
    kv = list(torch.randn(LAYERS, BLOCKS, 2, BLOCK, HIDDEN).to(torch.bfloat16).unbind(0))
    original = [t.clone() for t in kv]
    pages, host = PagedKV(kv, GEO), HostTier(1, GEO.chunk_bytes)
    pages.gather((3, 4, 7, 8), host.slot(0))  # sliding group: blocks 3, 4; full group: 7, 8
    for t in kv:
        t[9:].zero_()
    pages.scatter(host.slot(0), (NULL_BLOCK, 10, 9, 11), 0)  # the sliding window keeps one
    same = lambda a, b: torch.equal(a.view(torch.int16), b.view(torch.int16))  # noqa: E731
    for layer in (0, 1):  # sliding-window layers: page 1 into block 10, nothing into block 0
        assert same(kv[layer][10], original[layer][4]) and same(kv[layer][0], original[layer][0])
        assert not kv[layer][9].any() and not kv[layer][11].any()
    for layer in (2, 3):  # full-attention layers: both pages
        assert same(kv[layer][9], original[layer][7]) and same(kv[layer][11], original[layer][8])
    assert pages.bytes_of((NULL_BLOCK, 10, 9, 11)) == (2 * 1 + 2 * 2) * GEO.page_bytes
    with pytest.raises(ValueError, match="null block"):
        pages.gather((NULL_BLOCK, 4, 7, 8), host.slot(0))
    with pytest.raises(ValueError, match="group after group"):
        pages.scatter(host.slot(0), (10, 9, 11), 0)


def hybrid_scheduler() -> SchedulerSide:
    geo = KVGeometry(2, 4096, BLOCK, BLOCK, CHUNK, "bfloat16", "t", group_layers=(1, 1),
                     group_kinds=("sliding32", "full"))
    config = load_config({"chunk_tokens": CHUNK, "host_capacity": 4 * geo.chunk_bytes,
                          "load_policy": "always"}, environ={})
    return SchedulerSide(config, geo, [geo.namespace("m", "", 1, 0)], 1)


def test_a_chunk_out_of_a_groups_window_is_not_stored_nor_any_after_it():
    side, meta = hybrid_scheduler(), StepPlan()
    req = request("a", 3 * CHUNK)
    sliding_blocks = [NULL_BLOCK, NULL_BLOCK, 3, 4, 5, 6]  # chunk 0 fell out of the window
    side.plan_stores(req, (sliding_blocks, [11, 12, 13, 14, 15, 16]), 3 * CHUNK, meta)
    assert meta.stores == []
    meta = StepPlan()
    side.plan_stores(request("b", 2 * CHUNK, seed=1), ([1, 2, 3, 4], [11, 12, 13, 14]),
                     2 * CHUNK, meta)
    assert [s.block_ids for s in meta.stores] == [(1, 2, 11, 12), (3, 4, 13, 14)]


def test_after_a_hit_past_the_window_the_requests_new_chunks_are_stored():
    """A multi-turn chat: the history was a hit, so vLLM's window has dropped its early pages
    (null blocks); those chunks are cached already, and the new turn's chunk is stored."""
    side, meta = hybrid_scheduler(), StepPlan()
    first = request("a", 2 * CHUNK)
    side.plan_stores(first, ([1, 2, 3, 4], [11, 12, 13, 14]), 2 * CHUNK, meta)
    side.worker_report(WorkerReport(host_stored={s.key: 1 for s in meta.stores}))
    turn = request("b", 3 * CHUNK)  # a new request: the same history, one chunk further
    meta = StepPlan()
    window = [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 24, 25, 26]
    side.plan_stores(turn, (window, [31, 32, 33, 34, 35, 36]), 3 * CHUNK, meta)
    assert [s.block_ids for s in meta.stores] == [(25, 26, 35, 36)]
    assert not side.completes_chunks("b", 3 * CHUNK)


def test_a_request_whose_unstored_pages_left_the_window_stops_asking():
    side, meta = hybrid_scheduler(), StepPlan()
    req = request("a", 3 * CHUNK)
    side.plan_stores(req, ([NULL_BLOCK, NULL_BLOCK, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16]),
                     3 * CHUNK, meta)
    assert meta.stores == []
    assert not side.completes_chunks("a", 4 * CHUNK)  # no key hashed at every decode step


def test_a_hybrid_hit_loads_asynchronously_into_every_group():
    side, meta = hybrid_scheduler(), StepPlan()
    stored = request("a", 2 * CHUNK)
    side.plan_stores(stored, ([1, 2, 3, 4], [11, 12, 13, 14]), 2 * CHUNK, meta)
    side.worker_report(WorkerReport(host_stored={s.key: 1 for s in meta.stores}))
    again = Request("b", 2 * CHUNK + 1, stored.block_hashes)
    assert side.num_new_matched_tokens(again, 0) == (2 * CHUNK, True)  # from host, yet async
    side.plan_load(again, ([NULL_BLOCK, NULL_BLOCK, 5, 6, 7], [21, 22, 23, 24, 25]), 0, 2 * CHUNK)
    (load,) = side.build_meta().loads
    assert load.asynchronous
    assert [c.block_ids for c in load.chunks] == [(NULL_BLOCK, NULL_BLOCK, 21, 22), (5, 6, 23, 24)]


def test_a_failed_hybrid_load_is_reported_as_a_request_not_blocks():
    ledger = WorkerLedger()
    with ledger.lock:
        ledger.load_over("r", {5, 6}, asynchronous=True, whole=True)
        ledger.load_over("s", set(), asynchronous=True, whole=True)
    assert ledger.take_finished() == {"r", "s"}
    assert ledger.take_failed_loads() == {"r"} and ledger.take_invalid_blocks() == set()


def test_chunk_blocks_are_each_groups_blocks_group_after_group():
    assert chunk_blocks(([1, 2, 3], [7, 8, 9]), 1, 3) == (2, 3, 8, 9)


def test_kv_tensors_are_taken_in_chunk_order_by_name():
    from kvtier.connector.worker.pages import in_chunk_order

    geo = KVGeometry(2, 4096, BLOCK, BLOCK, CHUNK, "bfloat16", "t", group_layers=(1, 1),
                     layer_names=("sliding.0", "full.0"), group_kinds=("sliding32", "full"))
    full_t, sliding_t, alias = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    registered = {"full.0": full_t, "sliding.0": sliding_t, "shares.full.0": alias}
    ordered = in_chunk_order(registered, geo)  # extra (aliased) ones ignored
    assert len(ordered) == 2 and ordered[0] is sliding_t and ordered[1] is full_t
    with pytest.raises(ValueError, match=r"no KV tensor for \['sliding.0'\]"):
        in_chunk_order({"full.0": full_t}, geo)
