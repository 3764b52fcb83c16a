"""Page copies between a paged KV cache and host slots (the connector's copy path), on CPU."""

import pytest
import torch

from kvtier.connector.geometry import KVGeometry
from kvtier.connector.pages import PagedKV
from kvtier.tiers.host import HostTier

LAYERS, BLOCKS, BLOCK, HIDDEN = 3, 10, 4, 8


def paged(interleaved: bool) -> list[torch.Tensor]:
    """Per-layer (blocks, 2, block, hidden) views into one buffer, as vLLM allocates them:
    layer-major, or block-major (each layer's pages strided)."""
    if interleaved:
        whole = torch.randn(BLOCKS, LAYERS, 2, BLOCK, HIDDEN).to(torch.bfloat16)
        return [whole[:, i] for i in range(LAYERS)]
    whole = torch.randn(LAYERS, BLOCKS, 2, BLOCK, HIDDEN).to(torch.bfloat16)
    return list(whole.unbind(0))


def geometry(chunk_tokens=2 * BLOCK) -> KVGeometry:
    return KVGeometry(LAYERS, 2 * BLOCK * HIDDEN * 2, BLOCK, BLOCK, chunk_tokens, "bfloat16", "t")


@pytest.mark.parametrize("interleaved", [False, True])
def test_gather_then_scatter_moves_whole_pages(interleaved):
    kv = paged(interleaved)
    original = [t.clone() for t in kv]
    pages = PagedKV(kv, geometry())
    host = HostTier(2, 4096)
    pages.gather([7, 2], host.slot(0))
    chunk = host.slot(0)[: geometry().chunk_bytes].view(LAYERS, 2, -1)
    for layer in range(LAYERS):
        assert torch.equal(chunk[layer, 0], original[layer][7].flatten().view(torch.uint8))
        assert torch.equal(chunk[layer, 1], original[layer][2].flatten().view(torch.uint8))
    pages.scatter(host.slot(0), [5], first=1)  # the chunk's second page into block 5
    for layer in range(LAYERS):
        assert torch.equal(kv[layer][5].view(torch.int16), original[layer][2].view(torch.int16))
        assert torch.equal(kv[layer][4].view(torch.int16), original[layer][4].view(torch.int16))
    host.close()


def test_a_layout_that_does_not_match_is_refused():
    kv = paged(False)
    with pytest.raises(ValueError, match="expected 3"):
        PagedKV(kv[:2], geometry())
    wrong = KVGeometry(LAYERS, 999, BLOCK, BLOCK, 2 * BLOCK, "bfloat16", "t")
    with pytest.raises(ValueError, match="layout changed"):
        PagedKV(kv, wrong)


@pytest.mark.parametrize("bad", [[BLOCKS], [3, BLOCKS + 4], [-1]])
def test_block_ids_outside_the_cache_are_refused_not_skipped(bad):
    pages = PagedKV(paged(False), geometry())
    host = HostTier(2, 4096)
    with pytest.raises(IndexError, match="outside the KV cache"):
        pages.scatter(host.slot(0), bad, first=0)
    with pytest.raises(IndexError, match="outside the KV cache"):
        pages.gather(bad, host.slot(0))
    host.close()
