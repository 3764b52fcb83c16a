"""The warm tier: slots cut from one page-aligned host buffer, pinned when CUDA is present."""

from __future__ import annotations

import torch

from kvtier.io.buffers import AlignedBuffer
from kvtier.tiers.base import MemoryTier, TierName


class HostTier(MemoryTier):
    """Host memory slots. The same slots serve as O_DIRECT buffers for the disk tier."""

    name = TierName.HOST

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        super().__init__(num_slots, slot_bytes)
        self.buffer = AlignedBuffer(max(num_slots * slot_bytes, 1))
        self._whole = self.buffer.tensor()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def pinned(self) -> bool:
        return self.buffer.pinned

    def slot(self, index: int) -> torch.Tensor:
        self._check_index(index)
        start = index * self.slot_bytes
        return self._whole[start:start + self.slot_bytes]

    def slot_array(self, index: int):
        """Slot ``index`` as a numpy uint8 view (for I/O calls that take buffers)."""
        self._check_index(index)
        start = index * self.slot_bytes
        return self.buffer.array[start:start + self.slot_bytes]

    def close(self) -> None:
        self._whole = None  # type: ignore[assignment]
        self.buffer.close()
