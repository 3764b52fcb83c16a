"""A chunk in parts on disk: where each part lies in a slot, the header that checks each one,
and which runs of a slot a read of some parts moves.

A hybrid model's chunk holds each KV cache group's pages apart (``KVGeometry.part_bytes``);
written in parts (``io.format``), a load that fills only some groups reads only theirs.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence

import numpy as np

from kvtier.io.format import HEADER_BYTES, MAX_PARTS, SlotHeader, payload_checksum
from kvtier.keys import ChunkKey


class ChunkParts:
    """The parts of a chunk of ``raw_bytes`` (``sizes``: each part's bytes in order; () for
    one payload). ``readable``: whether a part can be read alone (it lies on page bounds,
    as O_DIRECT needs)."""

    def __init__(self, raw_bytes: int, sizes: Sequence[int] = ()) -> None:
        if sizes and (not 1 < len(sizes) <= MAX_PARTS or sum(sizes) != raw_bytes):
            raise ValueError(f"parts of {list(sizes)} bytes for chunks of {raw_bytes} (2 to "
                             f"{MAX_PARTS} parts, adding up to the chunk)")
        self.spans = list(itertools.pairwise(itertools.accumulate(sizes, initial=0)))
        self.readable = bool(sizes) and all(n % HEADER_BYTES == 0 for n in sizes)

    def __len__(self) -> int:
        return len(self.spans)

    def header(self, namespace: bytes, key: ChunkKey, raw: np.ndarray, generation: int,
               created_ns: int) -> SlotHeader:
        """The header of uncompressed chunk ``raw`` written in these parts."""
        return SlotHeader.in_parts(namespace, key, tuple(
            (end - at, payload_checksum(raw[at:end].data)) for at, end in self.spans),
            generation, created_ns)

    def reads_alone(self, wanted: Collection[int]) -> bool:
        """Whether a read of parts ``wanted`` (indexes) is a read of less than the chunk."""
        return self.readable and len(set(wanted)) < len(self.spans)

    def runs(self, header_buf: np.ndarray, dst: np.ndarray,
             wanted: Collection[int]) -> list[tuple[int, list[np.ndarray]]]:
        """(offset in the slot, buffers) of each vectored read of the header and parts
        ``wanted``, read into ``dst`` at their places in the chunk: adjacent ones together."""
        pieces = [(0, header_buf)] + [(HEADER_BYTES + at, dst[at:end])
                                      for i, (at, end) in enumerate(self.spans) if i in wanted]
        runs: list[tuple[int, list[np.ndarray]]] = []
        end = -1
        for at, buffer in pieces:
            if at == end:
                runs[-1][1].append(buffer)
            else:
                runs.append((at, [buffer]))
            end = at + buffer.size
        return runs

    def read_map(self, wanted: Collection[int]) -> list[tuple[int, bool]]:
        """(size, whether it is read) of every part: what ``slot_problem`` checks."""
        return [(end - at, i in wanted) for i, (at, end) in enumerate(self.spans)]
