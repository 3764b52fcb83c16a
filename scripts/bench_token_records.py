"""What naming a chunk from its token record costs the scheduler side (KV events of chunks on
disk: docs/vllm.md, "KV events"): decoding a slot header, reading its record, vLLM's hashes
of its blocks (sha256, its default) and the check that they make the chunk's key; the 4 KiB
read of the header is not included.

    python scripts/bench_token_records.py                  # chunks of 256 tokens
    python scripts/bench_token_records.py --chunk 512 --count 20000
"""

from __future__ import annotations

import argparse
import sys
import time
from array import array
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import init_none_hash  # noqa: E402

from kvtier.connector.common.geometry import KVGeometry  # noqa: E402
from kvtier.connector.scheduler.storage_events import StorageEvents  # noqa: E402
from kvtier.connector.vllm_events import VllmHashing  # noqa: E402
from kvtier.io.format import Codec, SlotHeader  # noqa: E402
from kvtier.io.token_record import encode_record  # noqa: E402
from kvtier.keys import block_hash_chunk_key  # noqa: E402


def naming_seconds(block: int, chunk: int, count: int) -> float:
    """Seconds to name one chunk of ``chunk`` tokens in blocks of ``block``, over ``count``."""
    geometry = KVGeometry(num_layers=2, page_bytes=4096, block_tokens=block,
                          hash_block_tokens=block, chunk_tokens=chunk, kv_dtype="bfloat16",
                          page_shape="t")
    namespace = geometry.namespace("m", "", 1, 0)
    hashing = VllmHashing(SimpleNamespace(cache_config=SimpleNamespace(
        prefix_caching_hash_algo="sha256")), block)
    tokens = array("i", range(1000, 1000 + chunk))
    key = block_hash_chunk_key(namespace, hashing.block_hashes(None, tokens, block)[-1])
    header = SlotHeader(namespace.digest(), key, Codec.NONE, 1, 1, 1, 1, 1).encode(
        record=encode_record(b"", tokens))
    assert header is not None
    reader = StorageEvents([], namespace, "bench", 8192, geometry, hashing)
    assert reader._named(key, header) is not None
    start = time.perf_counter()
    for _ in range(count):
        reader._named(key, header)
    return (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=256, help="tokens a chunk")
    parser.add_argument("--count", type=int, default=5000, help="chunks named")
    args = parser.parse_args()
    init_none_hash(sha256)
    for block in (16, 128):
        if args.chunk % block == 0:
            took = naming_seconds(block, args.chunk, args.count)
            print(f"blocks of {block} tokens, chunks of {args.chunk}: {took * 1e6:.1f} us a "
                  f"chunk named ({args.count} chunks)")


if __name__ == "__main__":
    main()
