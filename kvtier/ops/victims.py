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

import math
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvtier.io.format import SlotHeader
from kvtier.ops.cache import Segment

WINDOW_S = 30.0  # a prompt's chunks are written within this of its first (a long prefill's steps)
BLOCK = 4096  # chunks whose write times are looked at a time (as Python ints)


@dataclass(frozen=True, eq=False)
class SegmentChunks:
    """The chunks ``gc`` may free in one segment, as their index entries describe them: one
    array element a chunk (a few numbers each, never a Python object a chunk: a segment may
    hold millions)."""

    segment: Segment
    slots: np.ndarray  # int64
    generations: np.ndarray  # uint64: its writer's write count, a later write a larger one
    created_ns: np.ndarray  # uint64: when it was written, by its writer's clock
    stored_bytes: np.ndarray  # int64

    @classmethod
    def of(cls, segment: Segment, entries: Iterable[tuple[int, SlotHeader | None]]) -> SegmentChunks:
        """The chunks of the good ``entries`` (``index_entries``: a bad one is None)."""
        slots, generations, created, stored = array("q"), array("Q"), array("Q"), array("q")
        for slot, header in entries:
            if header is not None:
                slots.append(slot)
                generations.append(header.generation)
                created.append(header.created_ns)
                stored.append(header.payload_bytes)
        return cls(segment, *(np.frombuffer(numbers, dtype=numbers.typecode)
                              for numbers in (slots, generations, created, stored)))

    def __len__(self) -> int:
        return len(self.slots)


@dataclass(frozen=True, eq=False)
class FreeOrder:
    """Every chunk of some segments' ``SegmentChunks`` in the order ``gc`` frees them:
    ``chunks``, each an index into the segments' chunks one after another (``starts``: where
    each segment's begin); ``window_firsts`` and ``window_sizes``: the windows in that order,
    each's first write time and its count of chunks."""

    chunks: np.ndarray
    starts: np.ndarray
    window_firsts: np.ndarray
    window_sizes: np.ndarray


def _windows(written: SegmentChunks, window_s: float, chunks: np.ndarray,
             windows: np.ndarray) -> array:
    """One writer's chunks in write order (their indexes, into ``chunks``) and each's window
    there (numbered from 0, into ``windows``); returns each window's first write time."""
    order = np.argsort(written.generations, kind="stable")
    chunks[:] = order
    firsts, start = array("Q"), None
    for block in range(0, len(order), BLOCK):  # (a block at a time as Python ints)
        numbered = array("q")
        for created in written.created_ns[order[block:block + BLOCK]].tolist():
            if start is None or not 0 <= created - start < window_s * 1e9:
                start = created
                firsts.append(created)
            numbered.append(len(firsts) - 1)
        windows[block:block + len(numbered)] = np.frombuffer(numbered, dtype=np.int64)
    return firsts


def free_order(groups: list[SegmentChunks], window_s: float = WINDOW_S) -> FreeOrder:
    """The chunks of ``groups`` (one segment each) by write window (see the module
    docstring): oldest window first (by its first chunk, then by segment), each window's
    chunks last written first. Each chunk costs a few numbers at once, no more."""
    starts = np.cumsum([0] + [len(group) for group in groups], dtype=np.int64)
    ranks = {label: rank for rank, label in enumerate(sorted(g.segment.label for g in groups))}
    chunks, places = np.empty(starts[-1], np.int64), np.empty(starts[-1], np.int64)
    firsts, labels = array("Q"), array("q")
    for number, group in enumerate(groups):  # each writer's chunks in write order
        begin, end = starts[number], starts[number + 1]
        mine = _windows(group, window_s, chunks[begin:end], places[begin:end])
        chunks[begin:end] += begin
        places[begin:end] += len(firsts)
        firsts += mine
        labels += array("q", [ranks[group.segment.label]] * len(mine))
    window_firsts = np.frombuffer(firsts, dtype=np.uint64)
    windows = np.lexsort((np.frombuffer(labels, dtype=np.int64), window_firsts))
    place = np.empty(len(windows), dtype=np.int64)
    place[windows] = np.arange(len(windows))
    np.take(place, places, out=places)  # each chunk's window's place in the order
    sizes = np.bincount(places, minlength=len(windows))  # by place: in the order
    # windows in order, and within one (a run of one writer's chunks in write order) the
    # later first: a stable sort of the places read backwards
    order = np.argsort(places[::-1], kind="stable")
    del places
    np.subtract(len(order) - 1, order, out=order)
    return FreeOrder(chunks[order], starts, window_firsts[windows], sizes)


def victims(groups: list[SegmentChunks], older_than_s: float | None,
            target_bytes: int | None) -> list[tuple[SegmentChunks, np.ndarray]]:
    """The chunks to free, by segment (each an array of its indexes, in the order freed):
    every window whose first chunk was written more than ``older_than_s`` ago, then windows
    oldest first, each from its chunk written last, until at most ``target_bytes`` are
    stored."""
    found = free_order(groups)
    chosen = 0
    if older_than_s is not None:
        cutoff = time.time_ns() - older_than_s * 1e9  # a float: never overflows
        old = _before(found.window_firsts, cutoff)  # old windows lead
        chosen = int(found.window_sizes[:old].sum())
    if target_bytes is not None and groups:
        stored = np.concatenate([group.stored_bytes for group in groups])[found.chunks[chosen:]]
        over = int(stored.sum()) - target_bytes
        if over > 0:
            chosen += int(np.searchsorted(np.cumsum(stored), over)) + 1
    picked = found.chunks[:chosen]
    owner = np.searchsorted(found.starts, picked, side="right") - 1  # each one's segment
    by_owner = np.argsort(owner, kind="stable")  # (the order freed kept within each)
    ends = np.cumsum(np.bincount(owner, minlength=len(groups)))
    owners, first = np.unique(owner, return_index=True)  # segments by their first victim
    return [(groups[number], picked[by_owner[(ends[number - 1] if number else 0):ends[number]]]
             - found.starts[number]) for number in owners[np.argsort(first)].tolist()]


def _before(times: np.ndarray, cutoff: float) -> int:
    """How many of ``times`` (sorted, uint64) are before ``cutoff``, compared exactly (a
    float64 of today's nanoseconds is off by up to 256)."""
    limit = math.ceil(cutoff)  # an integer is below the cutoff if and only if below this
    if limit <= 0:
        return 0
    if limit >= 1 << 64:
        return len(times)
    return int(np.searchsorted(times, np.uint64(limit)))
