"""The keys of a request's chunks: vLLM's hash of each chunk's last block, in the engine's
namespace, with the request's LoRA adapter's files (``AdapterDigests``), and its prompt's
tail (``tails.prompt_tail``).

A request's adapter part is fixed once known (kept on its ``Tracked``), so its keys never
change between the match, the load, its stores and its hand-off; so is its epoch
(``Handoffs.epoch_of``: what a cache reset adds to every key made since), kept with it.
While its adapter's files are being read the request is asked about again (``pending``),
for ``ADAPTER_WAIT_S`` at most; past that it neither loads nor stores chunks (``keyable``
is False), as without kvtier.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.adapters import AdapterDigests
from kvtier.connector.scheduler.records import Tracked
from kvtier.connector.scheduler.tails import Tail, prompt_length, prompt_tail
from kvtier.keys import ChunkKey, Namespace, block_hash_chunk_key

ADAPTER_WAIT_S = 2.0  # a request waits this long for its adapter's files to be read
UNKEYABLE = b"unkeyable"  # a request whose adapter was not read in time (no digest is this)


class RequestKeys:
    """Contract: ``chunk_keys(tracked, count, first)`` are the keys of the request's chunks
    ``first`` to ``count - 1`` (fewer if its tokens run out; none unless ``keyable``);
    ``tail(tracked)`` its prompt's tail, worked out once per prompt length (None unless
    keyable); ``pending(tracked)`` whether its adapter is still being read."""

    def __init__(self, geometry: KVGeometry, namespace: Namespace,
                 epoch_of: Callable[[Any], bytes] = lambda request: b"",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.geometry, self.namespace, self._clock = geometry, namespace, clock
        self.adapters, self._epoch_of = AdapterDigests(), epoch_of

    def adapter(self, tracked: Tracked) -> bytes | None:
        """The adapter part of its keys, its epoch's after it: b"" (no adapter, no reset),
        None while its adapter is being read, ``UNKEYABLE`` once it waited
        ``ADAPTER_WAIT_S``."""
        if tracked.adapter is not None:
            return tracked.adapter
        tracked.adapter = self.adapters.of(tracked.request)
        if tracked.adapter is not None:
            tracked.epoch = self._epoch_of(tracked.request)
            tracked.adapter += tracked.epoch
        else:
            now = self._clock()
            if tracked.adapter_since is None:
                tracked.adapter_since = now
            if now - tracked.adapter_since >= ADAPTER_WAIT_S:
                tracked.adapter = UNKEYABLE
        return tracked.adapter

    def unkey(self, tracked: Tracked) -> None:
        """A request tracked at a cache reset neither loads nor stores any more: its keys
        name chunks of the weights before, and what vLLM holds of it was computed with them."""
        tracked.adapter = UNKEYABLE

    def pending(self, tracked: Tracked) -> bool:
        return self.adapter(tracked) is None

    def keyable(self, tracked: Tracked) -> bool:
        return self.adapter(tracked) not in (None, UNKEYABLE)

    def chunk_keys(self, tracked: Tracked, count: int, first: int = 0) -> list[ChunkKey]:
        per, hashes = self.geometry.hashes_per_chunk, tracked.request.block_hashes
        if not self.keyable(tracked):
            return []
        adapter = tracked.adapter or b""
        return [block_hash_chunk_key(self.namespace, hashes[(c + 1) * per - 1], adapter)
                for c in range(first, min(len(hashes) // per, count))]

    def tail(self, tracked: Tracked) -> Tail | None:
        """The request's prompt tail (a streaming session's prompt grows: its new tail is
        offered again)."""
        if not self.keyable(tracked):
            return None
        length = prompt_length(tracked.request)
        if tracked.tail_for != length:
            tracked.tail = prompt_tail(tracked.request, self.geometry, self.namespace,
                                       tracked.adapter or b"")
            tracked.tail_for, tracked.tail_done = length, False
        return tracked.tail

    def keys(self, tracked: Tracked, end: int) -> tuple[list[ChunkKey], int]:
        """Keys of the chunks covering the request's tokens up to ``end``: its full chunks,
        then its prompt's tail where they stop at it; and how far they reach (``end``, or
        the tail's end when that comes first: the tail holds nothing past the prompt)."""
        keys = self.chunk_keys(tracked, -(-end // self.geometry.chunk_tokens))
        tail = self.tail(tracked)
        if tail is not None and len(keys) == tail.index and end > tail.start:
            keys.append(tail.key)
            end = min(end, tail.end)
        return keys, end
