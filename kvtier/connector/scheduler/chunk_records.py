"""Token records (``kvtier.io.token_record``) of the chunks this engine writes to disk, and
the chunk a record read back names in KV events, checked against its key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.events import ChunkBlocks
from kvtier.io.token_record import TokenRecord, encode_record, record_room
from kvtier.keys import ChunkKey, Namespace, block_hash_chunk_key


class ChunkHashing(Protocol):
    """vLLM's block hashing, supplied by ``connector.py`` (``VllmHashing``) so that this
    module imports without vLLM: what else vLLM hashed of each block of a request's tokens
    ``start`` to ``stop`` (None: nothing), and vLLM's hash after each ``size`` tokens of
    ``tokens`` chained from ``parent`` (None: a prompt's first block)."""

    def extra_keys(self, request: Any, start: int, stop: int) -> tuple | None: ...

    def block_hashes(self, parent: bytes | None, tokens: Sequence[int], size: int) -> list[bytes]: ...


def chunk_record(blocks: ChunkBlocks | None, geometry: KVGeometry) -> bytes:
    """The token record of a chunk as its events name it (``chunk_blocks``); b"" when
    there is none to keep: vLLM has not hashed all its blocks (None), or hashed more than
    tokens of them (a cache salt, an adapter, multimodal inputs: a record keeps only
    tokens), or its tokens do not fit a header."""
    if blocks is None or geometry.chunk_tokens > record_room(0) \
            or blocks.extra_keys is not None or blocks.lora_name is not None:
        return b""
    return encode_record(blocks.parent or b"", blocks.tokens)


def record_blocks(record: TokenRecord, key: ChunkKey, geometry: KVGeometry, namespace: Namespace,
                  hashing: ChunkHashing) -> ChunkBlocks | None:
    """The chunk ``record`` names, as its events name it, or None unless the hashes of its
    tokens (chained from its parent) make ``key``: a record of another slot, or one that
    lies, names nothing."""
    if len(record.tokens) != geometry.chunk_tokens:
        return None
    try:
        hashes = hashing.block_hashes(record.parent or None, record.tokens,
                                      geometry.hash_block_tokens)
    except Exception:  # a parent that is no hash of this engine's algorithm
        return None
    if len(hashes) != geometry.hashes_per_chunk \
            or block_hash_chunk_key(namespace, hashes[-1]) != key:
        return None
    scale = geometry.block_tokens // geometry.hash_block_tokens
    return ChunkBlocks(tuple(hashes[scale - 1::scale]), record.parent or None, record.tokens)
