"""Page copies between a paged KV cache and host slots (the connector's copy path), on CPU."""

import pytest
import torch

from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.worker.pages import PagedKV
from kvtier.tiers.host import HostTier

LAYERS, BLOCKS, BLOCK, HIDDEN = 3, 10, 4, 8


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU here (scripts/gpu_check.py runs there)"))]


def paged(interleaved: bool, device: str = "cpu") -> list[torch.Tensor]:
    """Per-layer (blocks, 2, block, hidden) views into one buffer, as vLLM allocates them:
    layer-major, or block-major (each layer's pages strided)."""
    if interleaved:
        whole = torch.randn(BLOCKS, LAYERS, 2, BLOCK, HIDDEN).to(torch.bfloat16).to(device)
        return [whole[:, i] for i in range(LAYERS)]
    whole = torch.randn(LAYERS, BLOCKS, 2, BLOCK, HIDDEN).to(torch.bfloat16).to(device)
    return list(whole.unbind(0))


def geometry(chunk_tokens=2 * BLOCK) -> KVGeometry:
    return KVGeometry(LAYERS, 2 * BLOCK * HIDDEN * 2, BLOCK, BLOCK, chunk_tokens, "bfloat16", "t")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_gather_then_scatter_moves_whole_pages(interleaved, device):
    kv = paged(interleaved, device)
    original = [t.cpu() for t in kv]
    pages = PagedKV(kv, geometry())
    host = HostTier(2, 4096)
    same = lambda a, b: torch.equal(a.cpu().view(torch.int16), b.view(torch.int16))  # noqa: E731
    pages.gather([7, 2], host.slot(0))  # a whole chunk
    pages.gather([4], host.slot(1))  # a tail: the rest of the slot zeroed
    pages.synchronize()
    chunk = host.slot(0)[: geometry().chunk_bytes].view(LAYERS, 2, -1)
    tail = host.slot(1)[: geometry().chunk_bytes].view(LAYERS, 2, -1)
    for layer in range(LAYERS):
        assert torch.equal(chunk[layer, 0], original[layer][7].flatten().view(torch.uint8))
        assert torch.equal(chunk[layer, 1], original[layer][2].flatten().view(torch.uint8))
        assert torch.equal(tail[layer, 0], original[layer][4].flatten().view(torch.uint8))
        assert not tail[layer, 1].any()
    pages.scatter(host.slot(0), [5], first=1)  # the chunk's second page into block 5
    pages.scatter(host.slot(0), [8, 9], first=0)  # the whole chunk into blocks 8 and 9
    pages.synchronize()
    for layer in range(LAYERS):
        assert same(kv[layer][5], original[layer][2])
        assert same(kv[layer][8], original[layer][7]) and same(kv[layer][9], original[layer][2])
        for block in set(range(BLOCKS)) - {5, 8, 9}:  # nothing else written
            assert same(kv[layer][block], original[layer][block])
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


def test_layers_of_one_allocation_are_seen_as_one_view_and_no_others_are():
    from kvtier.connector.worker.page_view import page_view
    from kvtier.connector.worker.pages import _stacked

    for interleaved in (False, True):
        layers = [page_view(t) for t in paged(interleaved)]
        stacked = _stacked(layers)
        assert stacked is not None and stacked.shape[0] == LAYERS
        assert all(torch.equal(stacked[i], layers[i]) for i in range(LAYERS))
    apart = [page_view(torch.zeros(BLOCKS, 2, BLOCK, HIDDEN, dtype=torch.bfloat16))
             for _ in range(LAYERS)]
    assert _stacked(apart) is None  # separate allocations
    one = page_view(paged(False)[0])
    assert _stacked([one, one]) is None  # the same layer twice
    whole = page_view(torch.zeros(BLOCKS * 4, 2, BLOCK, HIDDEN, dtype=torch.bfloat16))
    assert _stacked([whole[0:BLOCKS], whole[1:BLOCKS + 1]]) is None  # overlapping


def test_bytes_are_moved_as_wide_integers_only_where_both_sides_allow_it():
    from kvtier.connector.worker.pages import _wide

    a, b = torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 16, dtype=torch.uint8)
    assert [t.dtype for t in _wide(a, b)] == [torch.int64, torch.int64]
    assert [t.dtype for t in _wide(a[:, :12], b[:, :12])] == [torch.uint8, torch.uint8]
    assert [t.dtype for t in _wide(a[:, 1:9], b[:, :8])] == [torch.uint8, torch.uint8]  # unaligned
