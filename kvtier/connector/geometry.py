"""What kvtier needs to know about vLLM's paged KV cache, on both sides of the connector.

The scheduler side derives it from vLLM's ``KVCacheConfig``; the worker side checks it
against the KV tensors it is handed. A chunk in a host slot or on disk is the chunk's pages,
layer by layer: ``(num_layers, blocks_per_chunk, page_bytes)``, whole pages copied as bytes
(so the bytes are whatever vLLM keeps in a page, in whatever layout it uses).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.keys import Namespace

LAYOUT_NAME = "vllm-pages"
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one rank's paged KV cache and of kvtier's chunks over it."""

    num_layers: int
    page_bytes: int  # one block of one layer (K and V)
    block_tokens: int  # tokens per GPU block
    hash_block_tokens: int  # tokens per vLLM block hash
    chunk_tokens: int
    kv_dtype: str
    page_shape: str  # per-block tensor shape, as vLLM lays it out

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_tokens

    @property
    def hashes_per_chunk(self) -> int:
        return self.chunk_tokens // self.hash_block_tokens

    @property
    def chunk_bytes(self) -> int:
        return self.num_layers * self.blocks_per_chunk * self.page_bytes

    def namespace(self, model: str, revision: str, tp_size: int, tp_rank: int) -> Namespace:
        return Namespace(
            model=model, model_revision=revision, kv_dtype=self.kv_dtype,
            layout=f"{LAYOUT_NAME}:{self.num_layers}x{self.page_shape}",
            layout_version=LAYOUT_VERSION, block_tokens=self.block_tokens,
            chunk_tokens=self.chunk_tokens, tp_size=tp_size, tp_rank=tp_rank,
        )


def geometry_from_vllm(vllm_config, kv_cache_config, config: KVTierConfig) -> KVGeometry:
    """Build the geometry from vLLM's configs; ``ConfigError`` for what kvtier cannot serve."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"kvtier: this model has {len(groups)} KV cache groups (hybrid attention); kvtier "
            "serves models with one group of full-attention layers"
        )
    spec = groups[0].kv_cache_spec
    block = spec.block_size
    if config.chunk_tokens % block:
        config.check_block_tokens(block)
    hash_block = getattr(kv_cache_config, "hash_block_size", None) or block
    if config.chunk_tokens % hash_block:
        config.check_block_tokens(hash_block)
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError("kvtier: pipeline parallelism is not supported yet; use TP only")
    page_shape = f"{block}x{spec.num_kv_heads}x{spec.head_size}x{str(spec.dtype).removeprefix('torch.')}"
    return KVGeometry(
        num_layers=len(groups[0].layer_names), page_bytes=spec.page_size_bytes,
        block_tokens=block, hash_block_tokens=hash_block, chunk_tokens=config.chunk_tokens,
        kv_dtype=str(spec.dtype).removeprefix("torch."), page_shape=page_shape,
    )
