"""Moving a chunk's bytes between tiers, as the bookkeeping planned. No locks, no state."""

from __future__ import annotations

import torch

from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.tier_stack import Location
from kvtier.tiers.base import MemoryTier, TierName
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier


class Transfers:
    """Copies between the tiers of one store.

    Contract: ``copy(key, src, dst)`` moves one chunk and returns an :class:`IOResult`:
    memory-to-memory copies between any two memory tiers, host-to-disk writes and
    disk-to-host reads (verified: a bad slot is CORRUPT and ``dst`` must not be used). The
    caller owns both slots for the duration (``src`` pinned or reserved, ``dst`` reserved).
    """

    def __init__(self, memory: dict[TierName, MemoryTier], disk: DiskTier | None,
                 chunk_bytes: int, dtype: torch.dtype, chunk_shape: tuple[int, ...]) -> None:
        self.memory = memory
        self.disk = disk
        self.chunk_bytes = chunk_bytes
        self._dtype, self._shape = dtype, chunk_shape

    def view(self, loc: Location) -> torch.Tensor:
        """The chunk in a memory slot as a ``(layers, 2, chunk_tokens, hidden)`` view."""
        raw = self.memory[loc.tier].slot(loc.slot)[: self.chunk_bytes]
        return raw.view(self._dtype).view(self._shape)

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
