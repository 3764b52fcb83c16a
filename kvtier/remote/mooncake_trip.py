"""Round trips of one call of the log of token records on Mooncake Store
(``mooncake_log.py``) with one client, through the calling thread's registered scratch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.remote.mooncake_client import INVALID_PARAMS, RPC_FAIL, RPC_TIMEOUT, TRANSFER_FAIL

TOO_LARGE = -(1 << 62)  # a value larger than its buffer (no code of the store's)


class Trip:
    """Round trips of one call with one client, through a registered scratch; every code
    the store answered is in ``codes``; ``broken`` once the master did not answer."""

    def __init__(self, client: Any, area: Callable[[Any, int], np.ndarray]) -> None:
        self.client, self._area, self.codes = client, area, list[int]()
        self.ok = False

    @property
    def broken(self) -> bool:
        return any(code in (RPC_FAIL, RPC_TIMEOUT) for code in self.codes)

    def get(self, names: Sequence[str], sizes: Sequence[int]) -> list[bytes | int]:
        """Each value, or the code the store answered for it; ``TOO_LARGE`` where it read
        more than the size (a value larger than it answers a code too: ``settled``)."""
        offsets = np.cumsum([0, *sizes]).tolist()
        area = self._area(self.client, max(1, offsets[-1]))
        base = area.ctypes.data
        codes = self.client.batch_get_into(list(names), [base + at for at in offsets[:-1]], list(sizes))
        self.codes += codes
        return [bytes(area[at:at + code]) if 0 <= code <= size else (code if code < 0 else TOO_LARGE)
                for at, size, code in zip(offsets, sizes, codes, strict=False)]

    def settled(self, name: str, code: int, size: int) -> int:
        """``code``, which a get of ``name`` into ``size`` bytes answered, or ``TOO_LARGE``
        where it may mean a larger value and the store reports one, or the code it answers
        for the size (the value gone meanwhile, say)."""
        if code not in (INVALID_PARAMS, TRANSFER_FAIL):
            return code
        held = int(self.client.get_size(name))
        if held < 0:
            self.codes.append(held)
        return TOO_LARGE if held > size else (held if held < 0 else code)

    def put(self, names: Sequence[str], values: Sequence[bytes], upsert: bool = False) -> list[int]:
        offsets = np.cumsum([0, *map(len, values)]).tolist()
        area = self._area(self.client, offsets[-1])
        for at, value in zip(offsets, values, strict=False):
            area[at:at + len(value)] = np.frombuffer(value, np.uint8)
        call = self.client.batch_upsert_from if upsert else self.client.batch_put_from
        codes = call(list(names), [area.ctypes.data + at for at in offsets[:-1]], list(map(len, values)))
        self.codes += codes
        return list(codes)

    def held(self, names: Sequence[str]) -> list[bool]:
        """Whether the store holds each value (whole: one still being put is not held yet);
        one it failed to answer for counts as held."""
        codes = [int(code) for code in self.client.batch_is_exist(list(names))]
        self.codes += [code for code in codes if code < 0]
        return [code != 0 for code in codes]

    def remove(self, names: Sequence[str]) -> None:
        self.codes += self.client.batch_remove(list(names), True)
