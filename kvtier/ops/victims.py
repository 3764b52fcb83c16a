"""Which chunks ``kvtier gc`` frees, and in which order.

A prompt's chunks are written head first, and each chunk's key is chained over every chunk
before it: once a prompt's head is freed, its later chunks cannot be hit (until the head is
written again). What ``gc`` reads of a chunk, its index entry, names its key, its write
generation (its writer's count: larger is later) and when it was written, but not the prompt
it belongs to nor its place there: a key cannot be traced back to its parent's, and the token
record an engine may put in a slot's header (the block before the chunk) is there only for
some chunks, and only by reading every slot's header.

So chunks are freed by write window: a writer's chunks, in the order it wrote them, form
windows, each of a chunk and those its writer wrote less than ``WINDOW_S`` after it (the next
chunk starts the next window). ``--older-than`` frees every window whose first chunk is older
than that, whole; ``--target`` then frees windows oldest first (by their first chunk, over
every writer), each from the chunk written last back to the first, until at most the target
is stored. A prompt written within one window loses its tail before its head, and what is
kept of it is a head that can still be hit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvtier.ops.cache import Segment

WINDOW_S = 30.0  # a prompt's chunks are written within this of its first (a long prefill's steps)


@dataclass(frozen=True)
class Chunk:
    """One chunk ``gc`` may free, as its index entry describes it."""

    segment: Segment
    slot: int
    generation: int  # its writer's write count: a later write has a larger one
    created_ns: int  # when it was written, by its writer's clock
    stored_bytes: int


def windows(chunks: list[Chunk], window_s: float = WINDOW_S) -> list[list[Chunk]]:
    """``chunks`` by write window (see the module docstring), oldest window first, each
    window's chunks last written first."""
    by_writer: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        by_writer.setdefault(chunk.segment.label, []).append(chunk)
    found: list[list[Chunk]] = []
    for mine in by_writer.values():
        mine.sort(key=lambda c: c.generation)
        start = None
        for chunk in mine:
            if start is None or not 0 <= chunk.created_ns - start < window_s * 1e9:
                start = chunk.created_ns
                found.append([])
            found[-1].append(chunk)
    found.sort(key=lambda window: (window[0].created_ns, window[0].segment.label))
    return [window[::-1] for window in found]


def victims(chunks: list[Chunk], older_than_s: float | None,
            target_bytes: int | None) -> list[Chunk]:
    """The chunks to free: every window whose first chunk was written more than
    ``older_than_s`` ago, then windows oldest first, each from its chunk written last, until
    at most ``target_bytes`` are stored."""
    chosen: list[Chunk] = []
    kept = windows(chunks)
    if older_than_s is not None:
        cutoff = time.time_ns() - older_than_s * 1e9  # a float: never overflows
        old = [window for window in kept if window[-1].created_ns < cutoff]  # its first chunk
        kept = kept[len(old):]  # windows go oldest first: the old ones lead
        chosen = [chunk for window in old for chunk in window]
    if target_bytes is not None:
        stored = sum(chunk.stored_bytes for window in kept for chunk in window)
        for chunk in (chunk for window in kept for chunk in window):
            if stored <= target_bytes:
                break
            chosen.append(chunk)
            stored -= chunk.stored_bytes
    return chosen
