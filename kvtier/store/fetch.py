"""One chunk of a ``get`` on its way: where it is pinned, and the state of its read."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum

import numpy as np

from kvtier.keys import ChunkKey
from kvtier.shared.follower import Refs
from kvtier.store.direct import DirectTarget
from kvtier.tiers.base import TierName
from kvtier.tiers.prefix import InOther, InRemote, Ours
from kvtier.tiers.stack import Location, StorePlan

Source = Ours | InOther[Refs] | InRemote


class FetchState(Enum):
    HOT = "hot"  # in a memory tier: copy from ``loc``
    READING = "reading"  # its disk read (into ``plan.dst`` or ``direct``) is in flight
    STAGED = "staged"  # the read checked out: copy from ``plan.dst`` (pinned)
    LANDED = "landed"  # the read into the caller's tensor checked out: nothing to copy
    FAILED = "failed"  # the read failed: the chunk was dropped
    GIVEN_UP = "given up"  # not over by its deadline, or not needed any more


@dataclass
class Fetch:
    """One chunk of a ``get``: where it comes from (``source``: pinned there when it is
    this store's), and, from storage, its read into a host slot (``plan.dst``) or, from
    this store's disk, straight into the caller's tensor (``direct``: the target and the
    chunk's place in it)."""

    key: ChunkKey
    source: Source
    state: FetchState = FetchState.HOT
    read: Future | None = None
    plan: StorePlan | None = None  # the host slot the read fills
    deadline: float | None = None  # time.monotonic() by which the read must be over
    direct: tuple[DirectTarget, int] | None = None

    @property
    def tier(self) -> TierName:
        return self.source.tier

    @property
    def loc(self) -> Location:
        """This store's copy (a fetch from another writer or the remote store has none)."""
        assert isinstance(self.source, Ours), f"a fetch from {self.tier} is not this store's"
        return self.source.loc

    @property
    def other(self) -> Refs | None:
        """Another writer's copy, when the chunk comes from one."""
        return self.source.ref if isinstance(self.source, InOther) else None

    def order(self) -> int:
        """Where its read is in its source, for reading neighbours together."""
        if isinstance(self.source, Ours):
            return self.source.loc.slot
        return self.source.ref[0].slot if isinstance(self.source, InOther) else 0

    def target(self) -> Location | list[np.ndarray]:
        """Where the read lands: the host slot, or the pieces of the caller's tensor."""
        if self.direct is not None:
            target, index = self.direct
            return target.pieces(index)
        assert self.plan is not None, "a disk read lands in a host slot or the caller's tensor"
        return self.plan.dst


def fingerprint(key: ChunkKey) -> int:
    """What marks a disk slot as last read straight into a caller's tensor for ``key``."""
    return int.from_bytes(key[:8], "little") | 1  # never 0, the mark of "not read yet"
