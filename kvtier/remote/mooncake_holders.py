"""The holders of a Mooncake store out of service alone: a dead holder costs its own keys.

A value lives in one holder's memory (a client that lends the pool a segment, reached at its
transport endpoint, ``host:port``). When a holder dies, the master keeps naming it for its
keys until that holder's lease runs out (about 10 s by default), and every get of one of
them fails its transfer, the second one to a dead holder after the transfer's progress
timeout. So a holder whose transfer failed while the master answered goes out of service
alone for ``retry_s`` (``NodeOutages``): while any holder is out, a get first asks the master
which holders hold its keys (one round trip: ``batch_get_replica_desc``) and answers the keys
held only on holders out as ``PATH_DOWN`` without reading them, while the other holders
serve theirs. The first get after ``retry_s`` reads its keys again (the holder's trial).
A failed transfer that cannot be laid on a holder (the master names none) is the tier's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.io.result import IOResult, IOStatus
from kvtier.remote.mooncake_client import TRANSFER_FAIL, code_name
from kvtier.remote.node_outages import NodeOutages

Read = Callable[[list[int]], tuple[list[IOResult], bool]]
TRANSFER = code_name(TRANSFER_FAIL)  # in a result's detail: its transfer from a holder failed


def holders_of(client: Any, names: Sequence[str]) -> list[frozenset[str]]:
    """The transport endpoints of the memory replicas of each of ``names``, as the master
    says (empty for a key it does not hold, or where it did not answer)."""
    try:
        found = client.batch_get_replica_desc(list(names))
    except Exception:  # a client refusing the call: no holder is known
        return [frozenset()] * len(names)
    return [frozenset(_endpoints(found.get(name) if isinstance(found, dict) else None))
            for name in names]


def _endpoints(replicas: Any) -> set[str]:
    held = set()
    for replica in replicas or ():
        try:
            if replica.is_memory_replica():
                held.add(str(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint))
        except Exception:  # a replica of another kind, or one described otherwise
            continue
    return held


class Holders:
    """The holders of one Mooncake tier out of service alone; see the module docstring. Only
    a key with one holder says anything of it: a read of a key with several reads one of
    them, and which is not known."""

    def __init__(self, retry_s: float, store: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.outages = NodeOutages(retry_s, store, clock, noun="holder")
        self._clock = clock

    def read(self, client: Any, names: Sequence[str], read: Read) -> tuple[list[IOResult], IOResult | None]:
        """The results of a get of ``names``, ``read(indexes)`` reading those given (and
        saying whether the master answered); the keys held only on holders out are answered
        unread. Also the failure no holder could be blamed for (the tier's), or None."""
        held = holders_of(client, names) if self.outages.any() else None
        skipped = self._skipped(held) if held is not None else {}
        at = [i for i in range(len(names)) if i not in skipped]
        results: list[IOResult] = [skipped.get(i, IOResult(IOStatus.PATH_DOWN)) for i in range(len(names))]
        if not at:
            return results, None
        asked_at = self._clock()  # an answer read before a holder's later failure is no news
        got, answered = read(at)
        for i, result in zip(at, got, strict=True):
            results[i] = result
        if not answered:  # the master did not answer: the tier's failure, said already
            return results, None
        return results, self._settle(client, names, at, results, held, asked_at)

    def servable(self, held: Sequence[bool], found: Sequence[frozenset[str]] | None) -> list[bool | None]:
        """``held`` (whether the store holds each key), None for each held only on holders
        out now (``found``: ``holders_of`` them; no trial claimed: a lookup reads nothing)."""
        out = [bool(hs) and all(self.outages.out(h) is not None for h in hs) for hs in found or ()]
        return [None if i < len(out) and out[i] and h else h for i, h in enumerate(held)]

    def _skipped(self, held: list[frozenset[str]]) -> dict[int, IOResult]:
        """The answers of the keys whose every holder is out (one trial claimed per holder)."""
        verdict = {holder: self.outages.admit(holder) for holder in set().union(*held)}
        return {i: IOResult(IOStatus.PATH_DOWN, 0, str(verdict[next(iter(holders))]))
                for i, holders in enumerate(held)
                if holders and all(verdict[h] is not None for h in holders)}

    def _settle(self, client: Any, names: Sequence[str], at: list[int], results: list[IOResult],
                held: list[frozenset[str]] | None, asked_at: float) -> IOResult | None:
        """Holders whose transfers failed out, those that served back; the first failure
        laid on no holder (not a transfer's, or of a key the master names no holder of)."""
        failed = [i for i in at if results[i].status is IOStatus.IO_ERROR]
        if failed and held is None:
            held = [frozenset()] * len(names)
            for i, holders in zip(failed, holders_of(client, pick(names, failed)), strict=True):
                held[i] = holders
        blamed: dict[str, str] = {}  # holder -> what its first failed transfer said
        unblamed = None
        for i in failed:
            holders = held[i] if held is not None else frozenset()
            if TRANSFER not in results[i].detail or not holders:
                unblamed = unblamed or results[i]
            elif len(holders) == 1:
                blamed.setdefault(next(iter(holders)), results[i].detail)
        served = {h for i in at if results[i].ok and len(held[i]) == 1
                  for h in held[i]} if held is not None else set()
        for holder in served - blamed.keys():
            self.outages.answered(holder, asked_at)
        for holder, detail in blamed.items():
            self.outages.failed(holder, ConnectionError(detail))
        return unblamed


def pick(items: Sequence[Any], at: Sequence[int]) -> list[Any]:
    """``items[i]`` for each of ``at``."""
    return [items[i] for i in at]
