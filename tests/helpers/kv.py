"""The tests' small KV layout, KV bytes that name their tokens, and white-box looks at a store."""

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from kvtier.layout import KVLayout
from kvtier.tiers.index import SlotIndex
from kvtier.tiers.stack import TierStack

# 2 layers x K,V x 2 heads x 16 dims in bf16: 256 B per token; 16-token chunks of 4 KiB.
SMALL = KVLayout(num_layers=2, kv_heads=2, head_size=16, dtype="bfloat16")
CHUNK = 16
CHUNK_BYTES = SMALL.token_bytes * CHUNK


def make_kv(tokens, layout=SMALL) -> torch.Tensor:
    """KV whose bytes are a pure function of the token ids and their positions.

    Any chunk read back from the wrong prefix or the wrong slot differs from this.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    prefix = np.cumsum(tokens * 2654435761 % 65521) % 65521  # depends on the whole prefix
    layer = np.arange(layout.num_layers)[:, None, None, None]
    kv_index = np.arange(2)[None, :, None, None]
    lane = np.arange(layout.hidden)[None, None, None, :]
    values = prefix[None, None, :, None] * 31 + lane + kv_index * 7 + layer * 13
    as_int16 = torch.from_numpy((values % 32749).astype(np.int16))
    return as_int16.view(getattr(torch, layout.dtype)).contiguous()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


@contextlib.contextmanager
def bookkeeping(store) -> Iterator[TierStack]:
    """A store's bookkeeping under its lock, for tests that check its invariants (white-box:
    the one place tests reach into a ``KVStore``)."""
    with store._books.held() as held:
        yield held.stack


def index_of(store, tier) -> SlotIndex:
    """One tier's index of a store (read its counts; change it only through the store)."""
    with bookkeeping(store) as stack:
        return stack.indexes[tier]


def background_writes(store) -> int:
    """Chunks whose background disk writes are queued or running (white-box, as above: each
    holds a pin on its host slot and a reservation on its disk slot until it ends)."""
    return store._runner.disk_writes.writes_pending
