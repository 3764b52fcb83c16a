"""Pages copied byte for byte for every KV cache layout vLLM may pick, with the KV tensors
built by vLLM's own helpers as its workers build them (``create_kv_cache_views``)."""

import pytest
import torch

from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.worker.pages import PagedKV
from kvtier.tiers.host import HostTier

interface = pytest.importorskip("vllm.v1.kv_cache_interface")
KVCacheLayout = interface.KVCacheLayout

KNOWN = {"LBHNC": "HNC", "LBNHC": "NHC", "LHBNC": "HNC", "BLHNC": "HNC", "BLNHC": "NHC",
         "BHLNC": "HNC"}  # layout -> the order of a page's dims in memory
LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 3, 12, 16, 4, 8


def test_every_layout_vllm_has_is_known():
    assert {layout.name for layout in KVCacheLayout} == set(KNOWN), (
        "vLLM has a KV cache layout kvtier does not know: add it to KNOWN and check its pages")


def views(layout):
    """vLLM's per-layer ``[B, H, N, C]`` views of one allocation in ``layout``, random bytes."""
    spec = interface.FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                                       dtype=torch.bfloat16)
    size = LAYERS * BLOCKS * spec.page_size_bytes
    layer_stride, block_stride, *_ = interface.compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    tensor = interface.KVCacheTensor(size=size, layers=[f"l{i}" for i in range(LAYERS)],
                                     layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.randint(0, 255, (size,), dtype=torch.uint8)
    return interface.create_kv_cache_views(raw, spec, BLOCKS, layout, tensor), spec


def page_bytes(page: torch.Tensor, order: str) -> torch.Tensor:
    """A page's bytes in memory order (``order``: its dims H, N, C as laid out)."""
    logical = page.view(torch.uint8)  # (H, N, C bytes)
    return (logical if order == "HNC" else logical.permute(1, 0, 2)).contiguous().flatten()


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_gather_and_scatter_move_whole_pages_in_every_layout(name):
    kv, spec = views(KVCacheLayout[name])
    assert kv[0].shape[1:3] == (HEADS, BLOCK)  # logical [B, H, N, C]
    original = [t.clone() for t in kv]
    geo = KVGeometry(LAYERS, spec.page_size_bytes, BLOCK, BLOCK, 2 * BLOCK, "bfloat16", "t")
    pages, host = PagedKV(kv, geo), HostTier(1, geo.chunk_bytes)
    pages.gather([7, 2], host.slot(0))
    chunk = host.slot(0)[: geo.chunk_bytes].view(LAYERS, 2, -1)
    for layer in range(LAYERS):  # the page's memory bytes: the same for layouts of one order
        assert torch.equal(chunk[layer, 0], page_bytes(original[layer][7], KNOWN[name]))
        assert torch.equal(chunk[layer, 1], page_bytes(original[layer][2], KNOWN[name]))
    pages.scatter(host.slot(0), [5, 9], first=0)
    same = lambda a, b: torch.equal(a.view(torch.int16), b.view(torch.int16))  # noqa: E731
    for layer in range(LAYERS):
        assert same(kv[layer][5], original[layer][7]) and same(kv[layer][9], original[layer][2])
        for block in set(range(BLOCKS)) - {5, 9}:  # nothing else written
            assert same(kv[layer][block], original[layer][block])
    host.close()


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_the_namespace_tells_page_orders_apart(name):
    from types import SimpleNamespace

    from kvtier.config.settings import load_config
    from kvtier.connector.common.geometry import geometry_from_vllm

    spec = interface.FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                                       dtype=torch.bfloat16)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="m"),
                                  parallel_config=SimpleNamespace(pipeline_parallel_size=1))
    kv_cache_config = SimpleNamespace(kv_cache_groups=[interface.KVCacheGroupSpec(["l0"], spec)],
                                      kv_cache_layout=name)
    config = load_config({"chunk_tokens": 2 * BLOCK, "host_capacity": "4MiB"}, environ={})
    geo = geometry_from_vllm(vllm_config, kv_cache_config, config)
    assert geo.page_order == KNOWN[name]
    layout = geo.namespace("m", "", 1, 0).layout
    assert layout.endswith(":NHC") == (KNOWN[name] == "NHC")  # HNC keeps the CPU build's names


def test_kernel_blocks_are_grouped_into_vllms_blocks():
    """An attention kernel with smaller blocks than vLLM's: each block is two kernel blocks
    (dim 0 has twice the entries). With tokens outside heads a page's bytes are those of an
    engine that does not split; with heads outside tokens they would not be: refused."""
    raw = torch.randn(BLOCKS, BLOCK, HEADS, HEAD).to(torch.bfloat16)  # memory [B][N][H][C]
    kernel = raw.view(2 * BLOCKS, BLOCK // 2, HEADS, HEAD).permute(0, 2, 1, 3)  # [2B, H, N/2, C]
    geo = KVGeometry(1, raw[0].numel() * 2, BLOCK, BLOCK, BLOCK, "bfloat16", "t")
    pages, host = PagedKV([kernel], geo), HostTier(1, 4096)
    original = raw.clone()
    pages.gather([3], host.slot(0))
    assert torch.equal(host.slot(0)[: geo.chunk_bytes], original[3].flatten().view(torch.uint8))
    pages.scatter(host.slot(0), [8], first=0)
    assert torch.equal(raw[8].view(torch.int16), original[3].view(torch.int16))
    assert pages.num_blocks == BLOCKS
    heads_outside = torch.randn(BLOCKS, 2, HEADS, BLOCK // 2, HEAD).to(torch.bfloat16).flatten(0, 1)
    with pytest.raises(ValueError, match="kernel blocks laid out with heads outside tokens"):
        PagedKV([heads_outside], geo)
    host.close()
