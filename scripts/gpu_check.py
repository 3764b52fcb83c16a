"""Checks of kvtier's GPU path, for a machine with a CUDA GPU.

    python scripts/gpu_check.py [--json out/gpu_check.json]

1. KVStore round trip with a device pool on ``cuda`` over pinned host memory (demotion to host,
   promotion back), every byte compared.
2. Page gather/scatter between a synthetic paged KV cache on the GPU and pinned host slots
   (the connector's copy path), every byte compared.
3. Bandwidth of that path (GPU pages -> host slots, and back) as a ratio to plain torch copies
   of the same bytes between a contiguous GPU tensor and pinned host memory, in the same run.
4. The same gather/scatter for each of vLLM's six KV cache layouts (pages one run, or one run
   per head), with a sliding-window load that skips vLLM's null block, every byte compared,
   and each layout's gather bandwidth.
Exits 2 with a message on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvtier import KVLayout, KVStore
from kvtier.connector.geometry import KVGeometry
from kvtier.connector.pages import PagedKV
from kvtier.tiers.host import HostTier


def store_round_trip() -> dict:
    layout = KVLayout(num_layers=32, kv_heads=8, head_size=128, dtype="bfloat16")
    config = {"chunk_tokens": 256, "gpu_capacity": "256MiB", "host_capacity": "1GiB"}
    with KVStore(layout, config, model="gpu-check") as store:
        assert store.tiers["gpu"].device.type == "cuda" and store.tiers["host"].pinned
        tokens = list(range(8 * 256))  # 8 chunks of 32 MiB: 256 MiB, demotes to host
        kv = torch.randn(layout.shape(len(tokens)), dtype=torch.bfloat16, device="cuda")
        stored = store.put(tokens, kv)
        out = torch.empty_like(kv)
        loaded = store.get(tokens, out)
        same = torch.equal(out.view(torch.int16), kv.view(torch.int16))
        stats = store.stats()
    return {"stored_tokens": stored, "loaded_tokens": loaded, "identical": same,
            "demotions": stats.demotions, "promoted": stats.chunks_promoted}


def paged_cache(num_layers: int, num_blocks: int, block: int, hidden: int) -> list[torch.Tensor]:
    whole = torch.randn(num_layers, num_blocks, 2, block, hidden, dtype=torch.bfloat16, device="cuda")
    return list(whole.unbind(0))


def pages_check(rounds: int = 20) -> dict:
    layers, blocks, block, hidden, chunk_tokens = 32, 4096, 16, 1024, 256
    kv = paged_cache(layers, blocks, block, hidden)
    page_bytes = kv[0][0].numel() * 2
    geometry = KVGeometry(layers, page_bytes, block, block, chunk_tokens, "bfloat16", "test")
    pages = PagedKV(kv, geometry)
    slots = 64
    host = HostTier(slots, geometry.chunk_bytes)
    assert host.pinned, "host slots are not pinned"
    per_chunk = geometry.blocks_per_chunk
    generator = torch.Generator().manual_seed(0)
    ids = [(torch.randperm(blocks - 1, generator=generator)[:per_chunk] + 1).tolist()  # 0: null block
           for _ in range(slots)]
    for s in range(slots):
        pages.gather(ids[s], host.slot(s))
    pages.synchronize()
    view = host.slot(3)[: geometry.chunk_bytes].view(layers, per_chunk, page_bytes)
    picked = torch.tensor(ids[3], device="cuda")
    gathered_ok = all(torch.equal(view[layer].cuda(), pages.pages[layer][picked])
                      for layer in range(layers))
    targets = list(range(1, per_chunk + 1))
    pages.scatter(host.slot(3), targets, 0)
    pages.synchronize()
    scattered_ok = all(torch.equal(pages.pages[layer][1:per_chunk + 1].cpu(), view[layer])
                       for layer in range(layers))

    nbytes = slots * geometry.chunk_bytes
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        for s in range(slots):
            pages.gather(ids[s], host.slot(s))
        pages.synchronize()
    d2h = rounds * nbytes / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(rounds):
        for s in range(slots):
            pages.scatter(host.slot(s), ids[s], 0)
        pages.synchronize()
    h2d = rounds * nbytes / (time.perf_counter() - start)

    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = host.buffer.tensor()[:nbytes]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        pinned.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    ref_d2h = rounds * nbytes / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(rounds):
        device.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    ref_h2d = rounds * nbytes / (time.perf_counter() - start)
    host.close()
    gib = 2**30
    return {"gather_identical": gathered_ok, "scatter_identical": scattered_ok,
            "chunk_bytes": geometry.chunk_bytes, "d2h_gib_s": d2h / gib, "h2d_gib_s": h2d / gib,
            "torch_d2h_gib_s": ref_d2h / gib, "torch_h2d_gib_s": ref_h2d / gib,
            "d2h_vs_torch": d2h / ref_d2h, "h2d_vs_torch": h2d / ref_h2d}


# vLLM's KVCacheLayout members: the physical order of the logical axes [L, B, H, N, C]
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def layout_views(order: tuple[int, ...], shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Per-layer logical [B, H, N, C] bf16 views of one CUDA allocation laid out in ``order``."""
    physical = [shape[axis] for axis in order]
    raw = torch.randn(physical, dtype=torch.bfloat16, device="cuda")
    logical = raw.permute([order.index(axis) for axis in range(5)])  # back to [L, B, H, N, C]
    return list(logical.unbind(0))


def layouts_check(rounds: int = 5) -> dict:
    layers, blocks, heads, block, head = 32, 1024, 8, 16, 256  # C: K and V of 128 dims
    out = {}
    for name, order in LAYOUTS.items():
        kv = layout_views(order, (layers, blocks, heads, block, head))
        page_bytes = heads * block * head * 2
        geometry = KVGeometry(layers, page_bytes, block, block, 256, "bfloat16", "test")
        pages, host = PagedKV(kv, geometry), HostTier(4, geometry.chunk_bytes)
        per = geometry.blocks_per_chunk
        ids = list(range(1, per + 1))
        original = [t.clone() for t in kv]
        pages.gather(ids, host.slot(0))
        pages.synchronize()
        tokens_outside = order.index(3) < order.index(2)  # NHC: tokens outside heads
        first = original[0][ids[0]].view(torch.uint8)  # [H, N, C bytes]
        expected = (first.permute(1, 0, 2) if tokens_outside else first).contiguous().flatten()
        bytes_ok = torch.equal(host.slot(0)[:page_bytes].cuda(), expected)
        window = [0] * (per // 2) + list(range(200, 200 + per // 2))  # the first half: null
        pages.scatter(host.slot(0), window, 0)
        pages.synchronize()
        ok = all(torch.equal(kv[layer][200:200 + per // 2], original[layer][1 + per // 2:1 + per])
                 and torch.equal(kv[layer][0], original[layer][0]) for layer in range(layers))
        torch.cuda.synchronize()
        start = time.perf_counter()
        for r in range(rounds):
            pages.gather(ids, host.slot(1 + r % 3))
        pages.synchronize()
        seconds = time.perf_counter() - start
        out[name] = {"identical": ok and bytes_ok, "page_bytes_in_memory_order": bytes_ok,
                     "d2h_gib_s": rounds * geometry.chunk_bytes / seconds / 2**30}
        host.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine; nothing to check", file=sys.stderr)
        raise SystemExit(2)
    result = {"device": torch.cuda.get_device_name(), "store": store_round_trip(),
              "pages": pages_check(), "layouts": layouts_check()}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    ok = result["store"]["identical"] and result["pages"]["gather_identical"] \
        and result["pages"]["scatter_identical"] \
        and all(check["identical"] for check in result["layouts"].values())
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
