"""Every copy of one chunk a disk tier's index files name. The bookkeeping knows one slot per
key, but a slot given back without being written over (a read that failed or was given up
on, a write cancelled at close, a path brought back empty) keeps its header and index entry:
a key stored again since lies in two slots, and a start-up keeps the newer. So a chunk
removed on purpose (found wrong by verification) has each copy blanked, or an older one
would come back at the next start."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np

from kvtier.io.format import INDEX_ENTRY_BYTES
from kvtier.keys import ChunkKey
from kvtier.segment.index_file import valid_header

if TYPE_CHECKING:
    from kvtier.disk.lane import DiskLane, NoDisk
    from kvtier.disk.tier import DiskTier

KEY_AT = struct.calcsize("<8sHHBBH16s")  # a header's key, after its magic, fields and namespace


def slots_naming(tier: DiskTier, key: ChunkKey) -> list[int]:
    """The slots whose index entries name ``key``, over the paths in service: one read of
    each path's index file (128 bytes a slot), its entries matched at once."""
    found: list[int] = []
    wanted = np.frombuffer(bytes(key), np.uint8)
    for index, path in enumerate(tier.paths.states):
        directory = path.dir
        if directory is None:
            continue
        try:
            data = directory.read_index()
        except OSError:  # its copies stay: a failing path is taken out, and back empty
            continue
        rows = np.frombuffer(data, np.uint8, len(data) // INDEX_ENTRY_BYTES * INDEX_ENTRY_BYTES)
        rows = rows.reshape(-1, INDEX_ENTRY_BYTES)[: tier.layout.per_path]
        for local in np.flatnonzero((rows[:, KEY_AT:KEY_AT + len(wanted)] == wanted).all(axis=1)):
            header = valid_header(rows[local].tobytes(), tier.ns_digest, tier.layout)
            if header is not None and header.key == key:
                found.append(int(local) * tier.layout.num_paths + index)
    return found


def blank_every_copy(lane: DiskLane | NoDisk, key: ChunkKey) -> None:
    """Blank each slot whose index entry names ``key`` (its header read under the slot's
    lock first: a slot written since with another chunk is left alone)."""
    if lane.tier is None:
        return
    for slot in slots_naming(lane.tier, key):
        lane.invalidate(slot, key)
