"""Where each chunk of a prefix is: one walk over every source, hottest first.

A chunk is found in this store's (or engine's) own tiers (``Ours``), else in another
writer's segment of a shared directory (``InOther``), else in the remote store
(``InRemote``). A prefix ends at its first chunk found nowhere: a key names its whole
prefix, so nothing past a miss can be used. The standalone store and vLLM's scheduler
side both walk prefixes with these two functions; what each source is (a tier stack, a
follower of other writers, a remote store's answer) is theirs to pass in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierName
from kvtier.tiers.stack import Location

Ref = TypeVar("Ref")


@dataclass(frozen=True)
class Ours:
    """A copy in this store's own tiers, at ``loc``."""

    loc: Location

    @property
    def tier(self) -> TierName:
        return self.loc.tier


@dataclass(frozen=True)
class InOther(Generic[Ref]):
    """A copy in another writer's segment; ``ref`` says where (the follower's own type)."""

    ref: Ref
    tier: ClassVar[TierName] = TierName.SHARED


@dataclass(frozen=True)
class InRemote:
    """A copy the remote store said it holds."""

    tier: ClassVar[TierName] = TierName.REMOTE


IN_REMOTE = InRemote()


def find(key: ChunkKey, locate: Callable[[ChunkKey], Location | None],
         theirs: Callable[[ChunkKey], Ref | None] | None) -> Ours | InOther[Ref] | None:
    """Where ``key`` is hottest here: this store's tiers first, then other writers'
    segments (``theirs``; None: none are followed); None when neither holds it."""
    loc = locate(key)
    if loc is not None:
        return Ours(loc)
    ref = theirs(key) if theirs is not None else None
    return InOther(ref) if ref is not None else None


def walk_cached(keys: Sequence[ChunkKey], locate: Callable[[ChunkKey], Location | None],
                theirs: Callable[[ChunkKey], Ref | None] | None) -> list[Ours | InOther[Ref]]:
    """Where each chunk of the longest prefix of ``keys`` held here or by another writer
    is (the caller holds whatever lock ``locate`` and ``theirs`` need)."""
    found: list[Ours | InOther[Ref]] = []
    for key in keys:
        where = find(key, locate, theirs)
        if where is None:
            break
        found.append(where)
    return found


def walk_remote(tail: Sequence[ChunkKey],
                held: Callable[[Sequence[ChunkKey]], Sequence[bool] | None] | None,
                here: Callable[[ChunkKey], Ours | InOther[Ref] | None] | None = None
                ) -> list[Ours | InOther[Ref] | InRemote] | None:
    """The prefix walk past what is cached here, with the remote store's one answer for the
    whole of ``tail`` (``held``: a flag per key; None: the store has not answered yet, and
    neither does this walk): each chunk where it is cached here (``here``: past a chunk only
    the store holds, a later one may be cached here again, and is taken from here whether the
    store holds it or not), else in the store, up to the first chunk held by neither. Nothing
    without a remote store or a tail."""
    if held is None or not tail:
        return []
    answer = held(tail)
    if answer is None:
        return None
    flags = list(answer[:len(tail)]) + [False] * (len(tail) - len(answer))
    found: list[Ours | InOther[Ref] | InRemote] = []
    for key, present in zip(tail, flags, strict=True):
        where = here(key) if here is not None else None
        if where is None and not present:
            break
        found.append(IN_REMOTE if where is None else where)
    return found
