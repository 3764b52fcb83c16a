"""How close a checked chunk must be to the fresh one (``kvtier.store.tolerance``): each
layer's K and V (in vLLM, of each page) on its own scale, so a V part or a layer of small
values replaced by another prompt's is caught while rounding noise passes; infinities never
set the scale and must sit where the fresh ones do."""

import pytest
import torch

from kvtier import KVStore
from kvtier.layout import KVLayout
from kvtier.store.tolerance import default_tolerance, same_kv, within
from tests.helpers.store import seq

L, BLOCKS, TOK, HEADS, HD = 4, 2, 16, 2, 32


def pages(v_scale: float, k_scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    """A chunk's pages as vLLM's CPU attention lays them: ``(layers, blocks, 2, heads,
    tokens, head size)``, K with an outlier channel as real models' K has."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, BLOCKS, HEADS, TOK, HD, generator=g) * k_scale
    v = torch.randn(L, BLOCKS, HEADS, TOK, HD, generator=g) * v_scale
    k[..., 0] = 20.0
    return torch.stack([k, v], 3)  # a head's run: its tokens' K, then their V


def same(cached: torch.Tensor, fresh: torch.Tensor, dtype: str, tolerance=None) -> bool:
    tolerance = default_tolerance(dtype) if tolerance is None else tolerance
    as_bytes = [t.contiguous().view(torch.uint8).flatten() for t in (cached, fresh)]
    return same_kv(*as_bytes, dtype, tolerance, L * BLOCKS, (TOK * HD, TOK * HD))


def test_rounding_noise_passes_and_a_right_chunk_is_right():
    fresh = pages(0.1)
    noisy = fresh * (1 + 2e-3 * torch.randn(fresh.shape))
    assert same(noisy.bfloat16(), fresh.bfloat16(), "bfloat16")
    assert same(fresh.half(), fresh.half(), "float16")


@pytest.mark.parametrize("wrong", ["zeroed", "another prompt's"])
def test_a_v_part_replaced_is_caught_beside_a_k_of_larger_values(wrong):
    fresh = pages(0.1).bfloat16()
    cached = fresh.clone()
    cached[:, :, :, 1] = 0 if wrong == "zeroed" else pages(0.1, seed=1).bfloat16()[:, :, :, 1]
    assert not same(cached, fresh, "bfloat16")


def test_a_layer_of_small_values_from_another_prompt_is_caught():
    fresh, other = pages(0.3), pages(0.3, seed=1)
    fresh[3] *= 0.02
    other[3] *= 0.02
    cached = fresh.clone()
    cached[3] = other[3]
    assert not same(cached.half(), fresh.half(), "float16")


def test_an_infinity_sets_no_scale_and_must_be_where_the_fresh_one_is():
    fresh = pages(0.3).half()
    fresh.view(-1)[0] = float("inf")
    zeros = torch.zeros_like(fresh)
    zeros.view(-1)[0] = float("inf")
    assert not same(zeros, fresh, "float16", 1e-2)
    moved = fresh.clone()
    moved.view(-1)[0], moved.view(-1)[1] = 20.0, float("inf")
    assert not same(moved, fresh, "float16", 1e-2)
    negative = fresh.clone()
    negative.view(-1)[0] = float("-inf")
    assert not same(negative, fresh, "float16", 1e-2)
    assert same(fresh.clone(), fresh, "float16", 1e-2)
    assert within(torch.tensor([[float("inf"), 1.0]]), torch.tensor([[float("inf"), 1.0]]), 0.0)


def test_the_store_checks_each_layers_k_and_v_on_its_own_scale():
    layout = KVLayout(num_layers=2, kv_heads=2, head_size=16, dtype="float32")
    cfg = {"chunk_tokens": 16, "host_capacity": 16 * layout.token_bytes * 16, "model": "m"}
    tokens = seq(0, 2)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 32, 32, generator=g)
    kv[:, 0] *= 1000  # K large, V small
    with KVStore(layout, cfg) as store:
        store.put(tokens, kv)
        assert store.verify_against(tokens, kv * (1 + 1e-5), tolerance=1e-3).ok
        wrong = kv.clone()
        wrong[1, 1, 16:] = torch.randn(16, 32, generator=g)  # chunk 1's V, layer 1
        store.put(tokens, kv)
        found = store.verify_against(tokens, wrong, tolerance=1e-2)
        assert found.checked == 2 and found.removed == (store.keys(tokens)[1],)


def test_the_geometry_says_how_k_and_v_lie_in_a_page(monkeypatch):
    """vLLM's logical page: a head's K then V for each token; its CPU attention: a head's
    tokens' K, then their V; an MLA page is one latent."""
    spec_types = pytest.importorskip("vllm.v1.kv_cache_interface")
    from kvtier.connector.common import page_values
    from kvtier.connector.common.geometry import geometry_from_vllm
    from tests.helpers.vllm_specs import BLOCK, CONFIG, full, vllm_configs

    monkeypatch.setattr(page_values, "_on_cpu", lambda: True)
    assert geometry_from_vllm(*vllm_configs(full()), CONFIG).kv_run == (BLOCK * 64, BLOCK * 64)
    monkeypatch.setattr(page_values, "_on_cpu", lambda: False)
    assert geometry_from_vllm(*vllm_configs(full()), CONFIG).kv_run == (64, 64)
    mla = spec_types.MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576,
                                      dtype=torch.bfloat16)
    assert page_values.kv_run(mla) == (0, 0)


def fp8_pair(noise: float):
    """A right fp8 chunk twice: rounding noise of ``noise`` before quantizing (a recompute
    in another batch shape) flips some bytes by one fp8 step."""
    x = pages(0.3)
    a = x.to(torch.float8_e4m3fn)
    b = (x * (1 + noise * torch.randn(x.shape, generator=torch.Generator().manual_seed(3))))
    return a, b.to(torch.float8_e4m3fn)


def fp8_same(a, b, dtype: str, tolerance=None):
    as_bytes = [t.view(torch.uint8).flatten() for t in (a, b)]
    return same_kv(*as_bytes, dtype, tolerance, L * BLOCKS, (TOK * HD, TOK * HD))


def test_an_fp8_cache_is_decoded_and_a_step_of_rounding_is_no_alarm():
    a, b = fp8_pair(1e-3)
    assert not torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # some bytes flipped
    assert fp8_same(a, b, "float8_e4m3fn") is True
    assert fp8_same(a, b, "float8_e4m3fn", 0.0) is False  # byte for byte when asked
    wrong = a.clone()
    wrong[:, :, :, 1] = pages(0.3, seed=1)[:, :, :, 1].to(torch.float8_e4m3fn)
    assert fp8_same(wrong, b, "float8_e4m3fn") is False
    e5 = [t.float().to(torch.float8_e5m2) for t in (a, b)]
    assert fp8_same(*e5, "float8_e5m2") is True


def test_an_explicit_tolerance_counts_for_every_dtype():
    a, b = fp8_pair(1e-3)
    assert fp8_same(a, b, "float8_e4m3fn", 1e-3) is False
    assert fp8_same(a, b, "float8_e4m3fn", 0.3) is True


def test_bytes_kvtier_cannot_decode_that_differ_are_no_verdict():
    """uint8 of unknown format (an integer cache, fp8 with inline scales): a recompute need
    not give the same bytes, so differing ones are neither right nor wrong."""
    a, b = fp8_pair(1e-3)
    assert fp8_same(a, b, "uint8") is None
    assert fp8_same(a, a.clone(), "uint8") is True
    assert fp8_same(a, b, "uint8", 0.0) is False  # byte for byte, as asked


def test_the_geometry_knows_an_fp8_caches_format():
    spec_types = pytest.importorskip("vllm.v1.kv_cache_interface")
    from kvtier.connector.common.geometry import geometry_from_vllm
    from tests.helpers.vllm_specs import BLOCK, CONFIG, full, vllm_configs

    def fp8(cache_dtype):
        spec = spec_types.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                            dtype=torch.uint8)
        return geometry_from_vllm(*vllm_configs(spec, cache_dtype=cache_dtype), CONFIG)

    assert fp8("fp8").value_dtype == fp8("fp8_e4m3").value_dtype == "float8_e4m3fn"
    assert fp8("fp8_e5m2").value_dtype == "float8_e5m2"
    assert fp8("fp8_ds_mla").value_dtype == "bytes"
    assert geometry_from_vllm(*vllm_configs(full()), CONFIG).value_dtype == "bfloat16"


def test_a_model_whose_v_heads_are_smaller_than_its_k_heads_is_checked_as_values(monkeypatch):
    """vLLM's ``head_size_v``: a token's content for a head is ``head_size`` values of K,
    then ``head_size_v`` of V. Such a page is decoded, and its K and V scaled apart: a V
    replaced by another prompt's is caught beside a K of larger values, and noise passes."""
    spec_types = pytest.importorskip("vllm.v1.kv_cache_interface")
    from kvtier.connector.common import page_values
    from kvtier.connector.common.geometry import geometry_from_vllm
    from tests.helpers.vllm_specs import BLOCK, CONFIG, vllm_configs

    spec = spec_types.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=192,
                                        head_size_v=128, dtype=torch.bfloat16)
    monkeypatch.setattr(page_values, "_on_cpu", lambda: False)
    geometry = geometry_from_vllm(*vllm_configs(spec), CONFIG)
    assert geometry.value_dtype == "bfloat16" and geometry.kv_run == (192, 128)
    monkeypatch.setattr(page_values, "_on_cpu", lambda: True)
    assert page_values.kv_run(spec) == (0, 0) and page_values.value_dtype(spec, "auto") == "bfloat16"

    g = torch.Generator().manual_seed(0)
    k = torch.randn(L, 2, BLOCK, 192, generator=g) * 10  # (layers, heads, tokens, K)
    v = torch.randn(L, 2, BLOCK, 128, generator=g) * 0.1
    fresh = torch.cat([k, v], -1).bfloat16()
    noisy = (fresh.float() * (1 + 2e-3 * torch.randn(fresh.shape, generator=g))).bfloat16()
    wrong = fresh.clone()
    wrong[2, ..., 192:] = (torch.randn(2, BLOCK, 128, generator=g) * 0.1).bfloat16()

    def check(cached):
        as_bytes = [t.contiguous().view(torch.uint8).flatten() for t in (cached, fresh)]
        assert as_bytes[0].numel() == L * spec.page_size_bytes
        return same_kv(*as_bytes, geometry.value_dtype, None, L, geometry.kv_run)

    assert check(noisy) is True and check(fresh.clone()) is True
    assert check(wrong) is False
