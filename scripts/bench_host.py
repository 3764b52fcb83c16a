"""Put and get N bytes through the host tier of ``kvtier.KVStore``, against ``numpy.copyto``.

Both are measured in the same run on the same bytes; the figure that counts is the ratio.

    python scripts/bench_host.py                      # 1 GiB in 1 MiB chunks
    python scripts/bench_host.py --size 4GiB --chunk 2MiB --json out/bench_host.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from kvtier import KVLayout, KVStore
from kvtier.units import format_size, parse_size

# 8 layers x K,V x 8 KV heads x 128 dims in bf16: 32 KiB of KV per token.
LAYOUT = KVLayout(num_layers=8, kv_heads=8, head_size=128, dtype="bfloat16")


def best_of(repeats: int, run) -> float:
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - start)
    return min(times)


def measure(total: int, chunk: int, repeats: int) -> dict:
    if chunk % LAYOUT.token_bytes:
        raise SystemExit(f"--chunk must be a multiple of {LAYOUT.token_bytes} bytes")
    chunk_tokens = chunk // LAYOUT.token_bytes
    num_tokens = (total // chunk) * chunk_tokens
    kv = torch.empty(LAYOUT.shape(num_tokens), dtype=torch.bfloat16)
    kv.view(torch.int16).random_()
    out = torch.zeros_like(kv)
    nbytes = kv.numel() * kv.element_size()

    store = KVStore(LAYOUT, {"host_capacity": nbytes, "chunk_tokens": chunk_tokens},
                    model="bench-host")
    # Each repeat stores new tokens: from the second on, every put also evicts a chunk.
    sequences = [np.arange(num_tokens, dtype=np.int64) + r * num_tokens for r in range(repeats)]

    def put(r: int) -> None:
        assert store.put(sequences[r], kv) == num_tokens

    def get(r: int) -> None:
        assert store.get(sequences[repeats - 1], out) == num_tokens

    put_s = best_of(repeats, put)
    get_s = best_of(repeats, get)
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16)), "bytes read back differ"
    store.close()

    src, dst = kv.view(torch.uint8).numpy(), out.view(torch.uint8).numpy()
    copy_s = best_of(repeats, lambda _: np.copyto(dst, src))
    gib = nbytes / 2**30
    return {
        "bytes": nbytes,
        "chunk_bytes": chunk,
        "chunks": nbytes // chunk,
        "torch_threads": torch.get_num_threads(),
        "put_gib_s": gib / put_s,
        "get_gib_s": gib / get_s,
        "copyto_gib_s": gib / copy_s,
        "put_ratio": copy_s / put_s,
        "get_ratio": copy_s / get_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="bytes per pass (default 1GiB)")
    parser.add_argument("--chunk", default="1MiB", help="chunk size (default 1MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="passes; the best counts")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(parse_size(args.size), parse_size(args.chunk), args.repeats)
    print(f"host tier, {format_size(result['bytes'])} in {result['chunks']} chunks of "
          f"{format_size(result['chunk_bytes'])} (torch threads: {result['torch_threads']})")
    print(f"  put    {result['put_gib_s']:6.2f} GiB/s   {result['put_ratio']:.2f} x numpy.copyto")
    print(f"  get    {result['get_gib_s']:6.2f} GiB/s   {result['get_ratio']:.2f} x numpy.copyto")
    print(f"  copyto {result['copyto_gib_s']:6.2f} GiB/s   (same bytes, same run)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
