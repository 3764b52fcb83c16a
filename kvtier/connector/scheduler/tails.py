"""A prompt's partial tail: the tokens after its last full chunk, stored once the prompt is
computed and loaded when the same prompt comes again, so that vLLM recomputes only its
last token.

A tail is keyed by vLLM's hash of the prompt's last full block (chained over the whole
prefix, cache salt and adapter included), the tokens after it and the adapter, so it
matches only an identical prompt. Prompts whose tokens do not say what the model saw
(multimodal inputs, prompt embeddings) have no tail, nor do models whose loads must
succeed or fail whole (hybrid and sliding-window models: ``KVGeometry.loads_whole``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.connector.common.geometry import KVGeometry
from kvtier.keys import ChunkKey, Namespace, tail_chunk_key


@dataclass(frozen=True)
class Tail:
    """The partial last chunk of a prompt: tokens ``start`` (a chunk boundary) to ``end``
    (the prompt's length), as chunk ``index`` of the request."""

    key: ChunkKey
    index: int
    start: int
    end: int


def prompt_length(request: Any) -> int | None:
    """The prompt's length, or None for a request that does not say (no tails then)."""
    length = getattr(request, "num_prompt_tokens", None)
    return length if isinstance(length, int) else None


def prompt_tail(request: Any, geometry: KVGeometry, namespace: Namespace,
                adapter: bytes = b"") -> Tail | None:
    """The request's tail, or None when its prompt ends on a chunk boundary (or one token
    past it), or may have none; ``adapter``: its LoRA adapter's digest (``AdapterDigests``)."""
    end = prompt_length(request)
    tokens = getattr(request, "prompt_token_ids", None)
    if end is None or tokens is None or geometry.loads_whole:
        return None
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    start = end // geometry.chunk_tokens * geometry.chunk_tokens
    if end - start < 2:  # none, or only the last token, which vLLM computes anyway
        return None
    full = end // geometry.hash_block_tokens  # the prompt's full blocks, as vLLM hashes them
    hashes = request.block_hashes
    if len(hashes) < full:
        return None
    parent = bytes(hashes[full - 1]) if full else b""
    return Tail(tail_chunk_key(namespace, parent, tokens[full * geometry.hash_block_tokens:end],
                               _extra(request) + adapter),
                start // geometry.chunk_tokens, start, end)


def _extra(request: Any) -> bytes:
    """What else vLLM keys a block on: the cache salt (in the first block's hash only, so
    needed where there is no full block) and the adapter, by name and path as vLLM does (an
    adapter's id means something only inside one process)."""
    salt = getattr(request, "cache_salt", None) or ""
    lora = getattr(request, "lora_request", None)
    name, path = (str(getattr(lora, "lora_name", "")), str(getattr(lora, "lora_path", ""))) \
        if lora else ("", "")
    return f"{len(salt)}:{salt}|{len(name)}:{name}|{len(path)}:{path}".encode()
