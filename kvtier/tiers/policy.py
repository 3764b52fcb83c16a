"""Eviction policies: small objects that only pick victims.

Contract (every implementation, checked by ``tests/test_policy.py``):

- The policy tracks a set of keys. ``insert`` adds a key (it must be absent), ``remove``
  drops it (it must be present), ``touch`` records an access to a present key.
- ``victim(evictable)`` returns the first tracked key in eviction order for which
  ``evictable(key)`` is true, or ``None``. It does not remove the key: the caller decides
  and then calls ``remove``. The owner passes a predicate that refuses pinned keys; since
  few keys are pinned at once, the scan past them is short.
- insert, remove and touch are O(1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable

from kvtier.config import EvictionPolicyName


class EvictionPolicy(ABC):
    """Chooses which evictable key goes first. See the module docstring for the contract."""

    @abstractmethod
    def insert(self, key: Hashable) -> None: ...

    @abstractmethod
    def remove(self, key: Hashable) -> None: ...

    @abstractmethod
    def touch(self, key: Hashable) -> None: ...

    @abstractmethod
    def victim(self, evictable: Callable[[Hashable], bool] = lambda key: True) -> Hashable | None:
        ...

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently inserted or touched goes first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        assert key not in self._order, "insert of a key already tracked"
        self._order[key] = None

    def remove(self, key: Hashable) -> None:
        del self._order[key]

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def victim(self, evictable: Callable[[Hashable], bool] = lambda key: True) -> Hashable | None:
        return next((key for key in self._order if evictable(key)), None)

    def __len__(self) -> int:
        return len(self._order)


class FIFOPolicy(LRUPolicy):
    """First inserted goes first; accesses do not reorder."""

    def touch(self, key: Hashable) -> None:
        assert key in self._order, "touch of an untracked key"


def make_policy(name: EvictionPolicyName | str) -> EvictionPolicy:
    """The policy named by the ``eviction_policy`` config key."""
    return {EvictionPolicyName.LRU: LRUPolicy, EvictionPolicyName.FIFO: FIFOPolicy}[
        EvictionPolicyName(name)
    ]()
