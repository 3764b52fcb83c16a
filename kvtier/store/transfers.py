"""Moving a chunk's bytes between tiers, as the bookkeeping planned. No locks, no state."""

from __future__ import annotations

import numpy as np
import torch

from kvtier.disk.tier import DiskTier
from kvtier.io.buffers import AlignedBuffer
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.store.chunk_runs import RAW_TORCH, Run, slot_rows
from kvtier.tiers.base import MemoryTier, TierName
from kvtier.tiers.host import HostTier
from kvtier.tiers.stack import Location


class Transfers:
    """Copies between the tiers of one store.

    Contract: ``copy(key, src, dst)`` moves one chunk and returns an :class:`IOResult`:
    memory-to-memory copies between any two memory tiers, host-to-disk writes and
    disk-to-host reads (verified: a bad slot is CORRUPT and ``dst`` must not be used). The
    caller owns both slots for the duration (``src`` pinned or reserved, ``dst`` reserved).
    A chunk of another memory tier goes to disk from a copy of its own (``staged``).
    """

    def __init__(self, memory: dict[TierName, MemoryTier], disk: DiskTier | None,
                 chunk_bytes: int, dtype: torch.dtype, chunk_shape: tuple[int, ...]) -> None:
        self.memory = memory
        self.disk = disk
        self.chunk_bytes = chunk_bytes
        self._raw, self._shape = RAW_TORCH[dtype.itemsize], chunk_shape
        host = memory.get(TierName.HOST)
        self._host_rows = None if not isinstance(host, HostTier) else slot_rows(
            host.buffer.array, host.num_slots, host.slot_bytes, chunk_bytes, dtype.itemsize,
            chunk_shape)

    def run_of(self, first: Location, count: int) -> Run:
        """``count`` memory slots that follow one another from ``first`` as one ``(count,
        layers, 2, chunk_tokens, hidden)`` run of raw integers (``chunk_runs``): a numpy
        view in host memory, a torch view elsewhere."""
        if first.tier is TierName.HOST and self._host_rows is not None:
            if first.slot < 0 or count < 1 or first.slot + count > len(self._host_rows):
                raise IndexError(f"host slots {first.slot}..{first.slot + count - 1} out of "
                                 f"range 0..{len(self._host_rows) - 1}")
            return self._host_rows[first.slot:first.slot + count]
        return self.view_run(first, count)

    def close(self) -> None:
        """Let go of the views of host memory (before the host tier is closed)."""
        self._host_rows = None

    def view(self, loc: Location) -> torch.Tensor:
        """The chunk in a memory slot as a ``(layers, 2, chunk_tokens, hidden)`` view of
        integers of the KV's element size (copy to and from it through ``chunk_runs.as_raw``)."""
        return self.view_run(loc, 1)[0]

    def view_run(self, first: Location, count: int) -> torch.Tensor:
        """``count`` slots that follow one another from ``first`` as one ``(count, layers, 2,
        chunk_tokens, hidden)`` view of integers of the KV's element size."""
        raw = self.memory[first.tier].slots(first.slot, count)[:, : self.chunk_bytes]
        return raw.view(self._raw).view(count, *self._shape)

    def copy(self, key: ChunkKey, src: Location, dst: Location) -> IOResult:
        if src.tier in self.memory and dst.tier in self.memory:
            self.view(dst).copy_(self.view(src))
            return IOResult(IOStatus.OK, self.chunk_bytes)
        host = self.memory.get(TierName.HOST)
        assert isinstance(host, HostTier) and self.disk is not None, f"no path {src} -> {dst}"
        if src.tier is TierName.HOST and dst.tier is TierName.DISK:
            return self.disk.write(dst.slot, key, host.slot_array(src.slot))
        if src.tier is TierName.DISK and dst.tier is TierName.HOST:
            return self.disk.read(src.slot, key, host.slot_array(dst.slot))
        raise ValueError(f"no transfer from {src.tier} to {dst.tier}")

    def host_array(self, loc: Location) -> np.ndarray:
        """The bytes of host slot ``loc``, as a reader fills them."""
        host = self.memory.get(TierName.HOST)
        assert isinstance(host, HostTier) and loc.tier is TierName.HOST, f"{loc} is no host slot"
        return host.slot_array(loc.slot)

    def staged(self, src: Location) -> np.ndarray:
        """A copy of a memory slot in page-aligned host memory of its own, for a disk write
        (``disk.write``) of a chunk outside host memory: the write reads the copy, whatever
        happens to the slot meanwhile."""
        tier = self.memory[src.tier]
        copy = AlignedBuffer(tier.slot_bytes, pin=False).array  # the view keeps the memory
        torch.from_numpy(copy).copy_(tier.slot(src.slot))
        return copy

    def read_many(self, items: list[tuple[ChunkKey, Location, Location | list[np.ndarray]]]
                  ) -> list[IOResult]:
        """Verified disk reads of several chunks (key, disk slot, and a host slot or the
        pieces the payload is scattered over); neighbouring disk slots move in one call."""
        host = self.memory.get(TierName.HOST)
        assert isinstance(host, HostTier) and self.disk is not None, "reads need host and disk"
        return self.disk.read_many([
            (src.slot, key, dst if isinstance(dst, list) else host.slot_array(dst.slot))
            for key, src, dst in items])
