"""Reading values from Mooncake Store into chunks: whole (a header and a payload piece each)
or some parts of each (``mooncake_ranges``), every value checked, the ones that fail their
checks removed (``mooncake_pieces.settle``). Which holders to read from is
``mooncake_holders``'s business, and the deadline ``MooncakeTier``'s."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from kvtier.io.result import IOResult
from kvtier.keys import ChunkKey
from kvtier.remote import mooncake_ranges
from kvtier.remote.mooncake_client import RPC_FAIL, RPC_TIMEOUT
from kvtier.remote.mooncake_memory import RegisteredMemory
from kvtier.remote.mooncake_pieces import get_result, settle
from kvtier.remote.values import ValueFormat

TripFailed = Callable[[str, Sequence[int]], IOResult | None]  # the master's failure in codes


class ValueReads:
    """The reads of one tier's values: ``form`` their layout, ``memory`` the registered
    memory and scratches, ``trip_failed`` what a round trip's codes say of the master.
    Each read answers its results and whether the master answered."""

    def __init__(self, form: ValueFormat, memory: RegisteredMemory, trip_failed: TripFailed) -> None:
        self.form, self.memory, self.trip_failed = form, memory, trip_failed

    def whole(self, client: Any, names: list[str], keys: list[ChunkKey],
              outs: list[np.ndarray]) -> tuple[list[IOResult], bool]:
        """A get of ``names`` whole into ``outs`` (each ``uint8``, ``raw_bytes`` at least)."""
        hb, raw = self.form.header_bytes, self.form.raw_bytes
        headers, payloads, staged = self.memory.pieces(client, outs)
        codes = client.batch_get_into_multi_buffers(
            names, [[h.ctypes.data, p.ctypes.data] for h, p in zip(headers, payloads, strict=True)],
            [[hb, raw]] * len(keys))
        failed = self.trip_failed("get", codes)
        results = [failed if failed is not None and item[2] in (RPC_FAIL, RPC_TIMEOUT)
                   else get_result(self.form, client, *item)
                   for item in zip(names, keys, codes, headers, payloads, strict=True)]
        settle(client, names, results)
        for result, out, payload, copy in zip(results, outs, payloads, staged, strict=True):
            if result.ok and copy:
                out[:raw] = payload
        return results, failed is None

    def ranges(self, client: Any, names: list[str], keys: list[ChunkKey], outs: list[np.ndarray],
               wanted: list[Collection[int]]) -> tuple[list[IOResult], bool]:
        """A get of the parts ``wanted`` of each of ``names`` into their places in ``outs``
        (in registered memory)."""
        area = self.memory.area(client, len(keys) * self.form.header_bytes)
        codes = mooncake_ranges.read_ranges(client, self.form, names, keys, outs, wanted, area)
        failed = self.trip_failed("get", [c for chunk in codes for c in chunk])
        if failed is not None:
            return [failed] * len(keys), False
        results = mooncake_ranges.outcomes(self.form, keys, codes, area, outs, wanted)
        settle(client, names, results)
        return results, True
