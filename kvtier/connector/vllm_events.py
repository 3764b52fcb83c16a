"""kvtier's KV events as vLLM's event types: made only while vLLM publishes its own."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from kvtier.connector.scheduler.events import ChunkBlocks


class VllmEvents:
    """kvtier's KV events (``scheduler/events.py``) as vLLM's ``BlockStored``/``BlockRemoved``,
    one per KV cache group, shaped as its offloading connector's (``locality`` LOCAL)."""

    def __init__(self, kv_cache_config: Any, block_tokens: int) -> None:
        self.block_tokens, specs = block_tokens, [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        self.groups = [(get_kv_cache_spec_kind(s).value, get_kv_cache_spec_sliding_window(s)) for s in specs]

    def extra_keys(self, request: Any, start: int, stop: int) -> tuple | None:
        size = self.block_tokens
        keys = to_event_extra_keys([generate_block_hash_extra_keys(request, at, at + size, 0)[0]
                                    for at in range(start, stop, size)]) or []
        return tuple(keys) if any(key is not None for key in keys) else None

    def stored(self, blocks: ChunkBlocks, medium: str) -> list[KVCacheEvent]:
        hashes = [maybe_convert_block_hash(h) for h in blocks.hashes]  # type: ignore[arg-type]
        parent = None if blocks.parent is None else maybe_convert_block_hash(blocks.parent)  # type: ignore[arg-type]
        return [BlockStored(block_hashes=hashes, parent_block_hash=parent,
                            token_ids=blocks.tokens.tolist(), block_size=self.block_tokens,
                            lora_id=blocks.lora_id, medium=medium, lora_name=blocks.lora_name,
                            extra_keys=list(blocks.extra_keys or ()) or None, group_idx=group,
                            kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
                            locality="LOCAL")
                for group, (kind, window) in enumerate(self.groups)]

    def removed(self, blocks: ChunkBlocks, medium: str) -> list[KVCacheEvent]:
        hashes = [maybe_convert_block_hash(h) for h in blocks.hashes]  # type: ignore[arg-type]
        return [BlockRemoved(block_hashes=hashes, medium=medium, group_idx=g, locality="LOCAL")
                for g in range(len(self.groups))]


def event_factory(vllm_config: Any, kv_cache_config: Any, block_tokens: int) -> VllmEvents | None:
    """The maker of kvtier's KV events while vLLM's are on (``enable_kv_cache_events``)."""
    events = getattr(vllm_config, "kv_events_config", None)
    if events is None or not events.enable_kv_cache_events:
        return None
    return VllmEvents(kv_cache_config, block_tokens)
