"""Eviction policies: small objects that only pick victims.

Contract (every implementation, checked by ``tests/test_policy.py``):

- The policy tracks a set of keys. ``insert`` adds a key (it must be absent), ``remove``
  drops it (it must be present), ``touch`` records an access to a present key.
- ``victim(evictable, in_use)`` returns the first tracked key in eviction order for which
  ``evictable(key)`` is true, or ``None``. It does not remove the key: the caller decides
  and then calls ``remove``. The owner passes a predicate that refuses pinned keys, and
  ``in_use`` that says which are pinned: each of those the scan passes goes to the end of
  the order (a second chance: it was in use when its turn came), so that keys pinned for
  long (writes to a disk that hangs) cost the scans after it nothing.
- insert, remove and touch are O(1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from kvtier.config.settings import EvictionPolicyName

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(ABC, Generic[K]):
    """Chooses which evictable key goes first. See the module docstring for the contract."""

    @abstractmethod
    def insert(self, key: K, first: bool = False) -> None:
        """Track ``key``; with ``first``, to go before every key tracked (a chunk found on
        disk while the tier runs is colder than those the run used)."""

    @abstractmethod
    def remove(self, key: K) -> None: ...

    @abstractmethod
    def touch(self, key: K) -> None: ...

    @abstractmethod
    def victim(self, evictable: Callable[[K], bool] = lambda key: True,
               in_use: Callable[[K], bool] | None = None) -> K | None:
        ...

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy[K]):
    """Least recently inserted or touched goes first."""

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K, first: bool = False) -> None:
        assert key not in self._order, "insert of a key already tracked"
        self._order[key] = None
        if first:
            self._order.move_to_end(key, last=False)

    def remove(self, key: K) -> None:
        del self._order[key]

    def touch(self, key: K) -> None:
        self._order.move_to_end(key)

    def victim(self, evictable: Callable[[K], bool] = lambda key: True,
               in_use: Callable[[K], bool] | None = None) -> K | None:
        found, passed = None, []
        for key in self._order:
            if evictable(key):
                found = key
                break
            if in_use is not None and in_use(key):
                passed.append(key)
        for key in passed:  # (after the scan: an OrderedDict is not changed while iterated)
            self._order.move_to_end(key)
        return found

    def __len__(self) -> int:
        return len(self._order)


class FIFOPolicy(LRUPolicy[K]):
    """First inserted goes first; accesses do not reorder."""

    def touch(self, key: K) -> None:
        assert key in self._order, "touch of an untracked key"


def make_policy(name: EvictionPolicyName | str) -> EvictionPolicy[Any]:
    """The policy named by the ``eviction_policy`` config key, for keys of any type."""
    return {EvictionPolicyName.LRU: LRUPolicy, EvictionPolicyName.FIFO: FIFOPolicy}[
        EvictionPolicyName(name)
    ]()
