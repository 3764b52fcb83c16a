"""Whether offload pays, per tier: the seconds of prefill each load saved against the
seconds it took.

A load's seconds are what its slowest rank measured (from its start to its last page in
the GPU); the prefill it saved is its tokens at the engine's own measured prefill speed
(``LoadDecider.prefill_seconds_per_token``, over steps that were mostly prefill). A load
reading from several tiers counts under the coldest of them (remote, then another engine's
segment, then disk, then host memory): that tier's reads decide how long it takes. A tier
whose loads took longer in all than the prefill they saved, over ``MIN_LOADS`` loads at
least, is said once (a warning) while it does not pay, and once again (info) when it pays
again; ``load_policy auto`` weighs each load on the same two measures."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping

from kvtier.tiers.base import TierName

log = logging.getLogger("kvtier")
COLDEST_FIRST = (TierName.REMOTE, TierName.SHARED, TierName.DISK, TierName.HOST)
MIN_LOADS = 20  # loads of a tier before it is judged


def coldest(tiers: Mapping[TierName, int]) -> TierName | None:
    """The coldest tier a load read tokens from (None: it read none)."""
    return next((tier for tier in COLDEST_FIRST if tiers.get(tier)), None)


class Payoff:
    """Contract: ``took(req_id, seconds)`` notes a rank's time for a request's load (the
    slowest rank's counts); ``over(req_id, tiers)``, once every rank's load of it is over
    (``tiers``: its tokens by tier), adds to ``load_s[tier]`` and ``saved_s[tier]`` (seconds,
    once the prefill speed is known: ``prefill_s_per_token()``), counts ``timed_loads_<tier>``
    in ``counters``, and says when a tier stops, or starts again, to pay."""

    def __init__(self, counters: Counter, prefill_s_per_token: Callable[[], float | None]) -> None:
        self._counters, self._prefill = counters, prefill_s_per_token
        self._seconds: dict[str, float] = {}
        self._losing: set[TierName] = set()
        self.load_s: dict[TierName, float] = {}  # seconds loads took, by coldest tier
        self.saved_s: dict[TierName, float] = {}  # seconds of prefill they saved

    def took(self, req_id: str, seconds: float) -> None:
        self._seconds[req_id] = max(seconds, self._seconds.get(req_id, 0.0))

    def over(self, req_id: str, tiers: Mapping[TierName, int] | None) -> None:
        seconds = self._seconds.pop(req_id, None)
        tier = coldest(tiers or {})
        rate = self._prefill()
        if seconds is None or tier is None or rate is None:
            return
        self.load_s[tier] = self.load_s.get(tier, 0.0) + seconds
        self.saved_s[tier] = self.saved_s.get(tier, 0.0) + sum((tiers or {}).values()) * rate
        self._counters[f"timed_loads_{tier}"] += 1
        self._judge(tier)

    def _judge(self, tier: TierName) -> None:
        counters = self._counters
        if counters[f"timed_loads_{tier}"] < MIN_LOADS:
            return
        took, saved = self.load_s[tier], self.saved_s[tier]
        if took > saved and tier not in self._losing:
            self._losing.add(tier)
            log.warning("kvtier: loads from %s took %.3g s in all and saved %.3g s of prefill "
                        "(%d loads): recomputing is faster; load_policy auto skips such loads "
                        "(kvtier_load_seconds_total, kvtier_seconds_saved_total)", tier, took,
                        saved, counters[f"timed_loads_{tier}"])
        elif took <= saved and tier in self._losing:
            self._losing.discard(tier)
            log.info("kvtier: loads from %s pay again (%.3g s took, %.3g s saved)", tier, took,
                     saved)
