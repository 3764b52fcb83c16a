"""The hot tier of the standalone store: a pool of device memory slots.

In vLLM the hot tier is vLLM's own paged KV cache; this pool is for :class:`kvtier.KVStore`.
It lives on ``cuda`` when a GPU is present, otherwise on the CPU as a stand-in, so the same
code runs and is tested on machines without a GPU.
"""

from __future__ import annotations

import torch

from kvtier.errors import ConfigError
from kvtier.io.buffers import AlignedBuffer
from kvtier.tiers.base import MemoryTier, TierName


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def pool_device(device: torch.device | str | int | None) -> torch.device:
    """The device a pool lives on (None: ``default_device``); ``ConfigError`` for one that
    is not a torch device, holds no data (``meta``), or is not usable in this process."""
    try:
        found = torch.device(device) if device is not None else default_device()
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"kvtier KVStore: device={device!r} is not a torch device ({exc}); "
                          "pass 'cuda', 'cuda:N' or 'cpu'") from exc
    if found.type == "meta":
        raise ConfigError(f"kvtier KVStore: device={device!r} holds no data; pass 'cuda', "
                          "'cuda:N' or 'cpu' for the device pool (gpu_capacity)")
    if found.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"kvtier KVStore: device={device!r}, but this torch sees no CUDA "
                          "device (a CPU build, or no GPU visible); pass device='cpu' or set "
                          "gpu_capacity to 0")
    return found


class DevicePool(MemoryTier):
    """``num_slots`` slots in one device allocation."""

    name = TierName.GPU

    def __init__(self, num_slots: int, slot_bytes: int, device: torch.device | str | None = None):
        super().__init__(num_slots, slot_bytes)
        self._device = pool_device(device)
        self._host_buffer: AlignedBuffer | None = None
        if self._device.type == "cpu":  # the stand-in: page-aligned like the host tier
            self._host_buffer = AlignedBuffer(max(num_slots * slot_bytes, 1), pin=False)
            whole = self._host_buffer.tensor()[: num_slots * slot_bytes]
            self._pool: torch.Tensor | None = whole.view(num_slots, slot_bytes)
        else:
            self._pool = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, device=self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    def slot(self, index: int) -> torch.Tensor:
        self._check_index(index)
        assert self._pool is not None, "slot() after close()"
        return self._pool[index]

    def slots(self, first: int, count: int) -> torch.Tensor:
        self._check_run(first, count)
        assert self._pool is not None, "slots() after close()"
        return self._pool[first:first + count]

    def close(self) -> None:
        self._pool = None
        if self._host_buffer is not None:
            self._host_buffer.close()
