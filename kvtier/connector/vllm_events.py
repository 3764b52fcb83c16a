"""kvtier's KV events as vLLM's event types: made only while vLLM publishes its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    generate_block_hash_extra_keys,
    hash_block_tokens,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from kvtier.connector.scheduler.events import OWNERSHIP, ChunkBlocks


class VllmHashing:
    """vLLM's block hashing as ``scheduler/chunk_records.py`` asks for it: the engine's
    ``prefix_caching_hash_algo``, chained from vLLM's seed (``NONE_HASH``, set once the
    engine is up: hash nothing before its first step)."""

    def __init__(self, vllm_config: Any, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)

    def extra_keys(self, request: Any, start: int, stop: int) -> tuple | None:
        size = self.block_tokens
        keys = to_event_extra_keys([generate_block_hash_extra_keys(request, at, at + size, 0)[0]
                                    for at in range(start, stop, size)]) or []
        return tuple(keys) if any(key is not None for key in keys) else None

    def block_hashes(self, parent: bytes | None, tokens: Sequence[int], size: int) -> list[bytes]:
        hashes: list[bytes] = []
        previous = None if parent is None else BlockHash(parent)
        for at in range(0, len(tokens) - size + 1, size):
            previous = hash_block_tokens(self.hash_fn, previous, tokens[at:at + size])
            hashes.append(bytes(previous))
        return hashes


class VllmEvents(VllmHashing):
    """kvtier's KV events (``scheduler/events.py``) as vLLM's ``BlockStored``/``BlockRemoved``,
    one per KV cache group, shaped as its offloading connector's (``locality`` LOCAL)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, block_tokens: int) -> None:
        super().__init__(vllm_config, block_tokens)
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        self.groups = [(get_kv_cache_spec_kind(s).value, get_kv_cache_spec_sliding_window(s)) for s in specs]

    def stored(self, blocks: ChunkBlocks, medium: str, remote: bool = False) -> list[KVCacheEvent]:
        hashes = [maybe_convert_block_hash(h) for h in blocks.hashes]  # type: ignore[arg-type]
        parent = None if blocks.parent is None else maybe_convert_block_hash(blocks.parent)  # type: ignore[arg-type]
        return [BlockStored(block_hashes=hashes, parent_block_hash=parent,
                            token_ids=blocks.tokens.tolist(), block_size=self.block_tokens,
                            lora_id=blocks.lora_id, medium=medium, lora_name=blocks.lora_name,
                            extra_keys=list(blocks.extra_keys or ()) or None, group_idx=group,
                            kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
                            **_where(remote))
                for group, (kind, window) in enumerate(self.groups)]

    def removed(self, blocks: ChunkBlocks, medium: str, remote: bool = False) -> list[KVCacheEvent]:
        hashes = [maybe_convert_block_hash(h) for h in blocks.hashes]  # type: ignore[arg-type]
        return [BlockRemoved(block_hashes=hashes, medium=medium, group_idx=g, **_where(remote))
                for g in range(len(self.groups))]


def _where(remote: bool) -> dict[str, str]:
    """``locality`` (and for the remote store ``ownership``, which vllm-router requires of
    a REMOTE block: its external tier) of one of kvtier's events."""
    return {"locality": "REMOTE", "ownership": OWNERSHIP} if remote else {"locality": "LOCAL"}


class GpuClears:
    """Whether vLLM cleared its GPU cache since the last look (``reset_prefix_cache``): the
    newest ``AllBlocksCleared`` in its block pool's queue of events is one not seen before.
    vLLM hands that queue to its publisher after the connector's looks of a step (its
    ``has_requests`` and ``build_connector_meta``), and kvtier's events right after it."""

    def __init__(self) -> None:
        self._last: AllBlocksCleared | None = None  # kept, so that its id is no other's

    def look(self, block_pool: Any) -> bool:
        for event in reversed(getattr(block_pool, "kv_event_queue", None) or ()):
            if isinstance(event, AllBlocksCleared):
                if event is self._last:
                    return False
                self._last = event
                return True
        return False


def event_factory(vllm_config: Any, kv_cache_config: Any, block_tokens: int) -> VllmEvents | None:
    """The maker of kvtier's KV events while vLLM's are on (``enable_kv_cache_events``)."""
    events = getattr(vllm_config, "kv_events_config", None)
    if events is None or not events.enable_kv_cache_events:
        return None
    return VllmEvents(vllm_config, kv_cache_config, block_tokens)
