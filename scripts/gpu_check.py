"""Checks of kvtier's GPU path, for a machine with a CUDA GPU.

    python scripts/gpu_check.py [--json out/gpu_check.json]

1. KVStore round trip with a device pool on ``cuda`` over pinned host memory (demotion to host,
   promotion back), then ``flush`` (the device pool's chunks too) and a restart that reads
   every chunk back from disk, every byte compared.
2. Page gather/scatter between a synthetic paged KV cache on the GPU and pinned host slots
   (the connector's copy path), every byte compared.
3. Bandwidth of that path (GPU pages -> host slots, and back) as a ratio to plain torch copies
   of the same bytes between a contiguous GPU tensor and pinned host memory, in the same run.
4. The same gather/scatter for each of vLLM's six KV cache layouts (pages one run, or one run
   per head), with a sliding-window load that skips vLLM's null block, every byte compared,
   and each layout's gather bandwidth.
Exits 2 with a message on a machine without a GPU.

``--device cpu --small`` runs the same checks on the CPU (no pinning, no side streams) at a
size that takes seconds: the tests run it, so the script itself is known to work before a
GPU machine's scarce time is spent on it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier import KVLayout, KVStore
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.worker.pages import PagedKV
from kvtier.tiers.base import TierName
from kvtier.tiers.host import HostTier


@dataclass(frozen=True)
class Sizes:
    """The shapes each check uses: a GPU's, or ``SMALL`` for a dry run on the CPU."""

    store_layers: int = 32  # the round trip: Llama-3-8B's layout, 8 chunks of 32 MiB
    store_kv_heads: int = 8
    pages_layers: int = 32  # the paged cache of the gather/scatter check
    pages_blocks: int = 4096
    pages_hidden: int = 1024
    layouts_layers: int = 32  # each KV cache layout's cache
    layouts_blocks: int = 1024
    rounds: int = 20  # timed rounds of the bandwidth figures


SMALL = Sizes(store_layers=2, store_kv_heads=2, pages_layers=4, pages_blocks=256,
              pages_hidden=128, layouts_layers=4, layouts_blocks=256, rounds=2)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def store_round_trip(device: torch.device, sizes: Sizes) -> dict:
    layout = KVLayout(num_layers=sizes.store_layers, kv_heads=sizes.store_kv_heads,
                      head_size=128, dtype="bfloat16")
    total = 8 * 256 * layout.token_bytes  # 8 chunks, half of them demoted to host memory
    disk = tempfile.mkdtemp(prefix="kvtier-gpu-check-")
    config = {"chunk_tokens": 256, "gpu_capacity": total // 2, "host_capacity": 4 * total,
              "disk_paths": [disk], "disk_capacity": 4 * total, "disk_min_free": 0,
              "write_policy": "write_back"}
    with KVStore(layout, config, model="gpu-check", device=device) as store:
        gpu, host = store.tiers[TierName.GPU], store.tiers[TierName.HOST]
        assert gpu.device.type == device.type, gpu.device
        assert isinstance(host, HostTier) and (host.pinned or device.type != "cuda"), \
            "host slots are not pinned"
        tokens = list(range(8 * 256))
        kv = torch.randn(layout.shape(len(tokens)), dtype=torch.bfloat16, device=device)
        stored = store.put(tokens, kv)
        out = torch.empty_like(kv)
        loaded = store.get(tokens, out)
        same = torch.equal(out.view(torch.int16), kv.view(torch.int16))
        stats = store.stats()
        flushed = store.flush(timeout=120)  # the device pool's chunks too (from copies)
    with KVStore(layout, config, model="gpu-check", device=device) as store:  # a restart: every chunk on disk
        again = torch.zeros_like(kv)
        reloaded = store.get(tokens, again)
        same_after = torch.equal(again.view(torch.int16), kv.view(torch.int16))
    shutil.rmtree(disk, ignore_errors=True)
    return {"stored_tokens": stored, "loaded_tokens": loaded, "identical": same and same_after,
            "demotions": stats.demotions, "promoted": stats.chunks_promoted,
            "flushed": bool(flushed), "flush_written": flushed.written,
            "reloaded_tokens_after_restart": reloaded}


def paged_cache(num_layers: int, num_blocks: int, block: int, hidden: int,
                device: torch.device) -> list[torch.Tensor]:
    whole = torch.randn(num_layers, num_blocks, 2, block, hidden, dtype=torch.bfloat16, device=device)
    return list(whole.unbind(0))


def pages_check(device: torch.device, sizes: Sizes) -> dict:
    layers, blocks, block, hidden = sizes.pages_layers, sizes.pages_blocks, 16, sizes.pages_hidden
    chunk_tokens, rounds = 256, sizes.rounds
    kv = paged_cache(layers, blocks, block, hidden, device)
    page_bytes = kv[0][0].numel() * 2
    geometry = KVGeometry(layers, page_bytes, block, block, chunk_tokens, "bfloat16", "test")
    pages = PagedKV(kv, geometry)
    slots = 64
    host = HostTier(slots, geometry.chunk_bytes)
    assert host.pinned or device.type != "cuda", "host slots are not pinned"
    per_chunk = geometry.blocks_per_chunk
    generator = torch.Generator().manual_seed(0)
    ids = [(torch.randperm(blocks - 1, generator=generator)[:per_chunk] + 1).tolist()  # 0: null block
           for _ in range(slots)]
    for s in range(slots):
        pages.gather(ids[s], host.slot(s))
    pages.synchronize()
    view = host.slot(3)[: geometry.chunk_bytes].view(layers, per_chunk, page_bytes)
    picked = torch.tensor(ids[3], device=device)
    gathered_ok = all(torch.equal(view[layer].to(device), pages.pages[layer][picked])
                      for layer in range(layers))
    targets = list(range(1, per_chunk + 1))
    pages.scatter(host.slot(3), targets, 0)
    pages.synchronize()
    scattered_ok = all(torch.equal(pages.pages[layer][1:per_chunk + 1].cpu(), view[layer])
                       for layer in range(layers))

    nbytes = slots * geometry.chunk_bytes
    sync(device)
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

    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = host.buffer.tensor()[:nbytes]
    sync(device)
    start = time.perf_counter()
    for _ in range(rounds):
        pinned.copy_(on_device, non_blocking=True)
    sync(device)
    ref_d2h = rounds * nbytes / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(rounds):
        on_device.copy_(pinned, non_blocking=True)
    sync(device)
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


def layout_views(order: tuple[int, ...], shape: tuple[int, ...],
                 device: torch.device) -> list[torch.Tensor]:
    """Per-layer logical [B, H, N, C] bf16 views of one allocation laid out in ``order``."""
    physical = [shape[axis] for axis in order]
    raw = torch.randn(physical, dtype=torch.bfloat16, device=device)
    logical = raw.permute([order.index(axis) for axis in range(5)])  # back to [L, B, H, N, C]
    return list(logical.unbind(0))


def layouts_check(device: torch.device, sizes: Sizes) -> dict:
    layers, blocks, heads, block, head = sizes.layouts_layers, sizes.layouts_blocks, 8, 16, 256
    rounds = max(1, sizes.rounds // 4)  # C (head): K and V of 128 dims each
    out = {}
    for name, order in LAYOUTS.items():
        kv = layout_views(order, (layers, blocks, heads, block, head), device)
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
        bytes_ok = torch.equal(host.slot(0)[:page_bytes].to(device), expected)
        window = [0] * (per // 2) + list(range(200, 200 + per // 2))  # the first half: null
        pages.scatter(host.slot(0), window, 0)
        pages.synchronize()
        ok = all(torch.equal(kv[layer][200:200 + per // 2], original[layer][1 + per // 2:1 + per])
                 and torch.equal(kv[layer][0], original[layer][0]) for layer in range(layers))
        sync(device)
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
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a dry run of the same checks on the CPU")
    parser.add_argument("--small", action="store_true", help="small shapes (seconds on a CPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine; nothing to check", file=sys.stderr)
        raise SystemExit(2)
    sizes = SMALL if args.small else Sizes()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)"
    result: dict[str, Any] = {"device": name, "store": store_round_trip(device, sizes),
              "pages": pages_check(device, sizes), "layouts": layouts_check(device, sizes)}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    store = result["store"]
    ok = store["identical"] and store["flushed"] \
        and store["reloaded_tokens_after_restart"] == store["stored_tokens"] \
        and result["pages"]["gather_identical"] \
        and result["pages"]["scatter_identical"] \
        and all(check["identical"] for check in result["layouts"].values())
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
