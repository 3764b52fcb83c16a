"""``load_policy = "auto"``: load a cached prefix only when that beats recomputing it.

Both speeds are measured while serving: load bandwidth from the workers' reports of each
load (bytes from disk and from host memory, and seconds), prefill speed from the engine's
own steps (tokens scheduled per second of step time, over steps that were mostly prefill).
Until both have been measured, loads go ahead, which is also how they get measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

_ALPHA = 0.2  # weight of a new sample in the moving averages
_MIN_PREFILL_TOKENS = 256  # steps with fewer scheduled tokens say little about prefill speed


@dataclass
class _Ewma:
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - _ALPHA) * self.value + _ALPHA * sample


class LoadDecider:
    """Decides per request whether loading beats recomputing; see the module docstring.

    ``clock`` (seconds, monotonic) times the engine's steps."""

    def __init__(self, enabled: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self._clock = clock
        self.disk_seconds_per_byte = _Ewma()
        self.host_seconds_per_byte = _Ewma()
        self.prefill_seconds_per_token = _Ewma()
        self._last_step: tuple[float, int] | None = None
        self.skipped = 0

    def observe_load(self, disk_bytes: int, host_bytes: int, seconds: float) -> None:
        """A finished load: ``disk_bytes`` read from disk, ``host_bytes`` copied to GPU."""
        if disk_bytes and seconds > 0:
            host_part = (self.host_seconds_per_byte.value or 0.0) * host_bytes
            self.disk_seconds_per_byte.add(max(seconds - host_part, 0.0) / disk_bytes)
        elif host_bytes and seconds > 0:
            self.host_seconds_per_byte.add(seconds / host_bytes)

    def observe_step(self, scheduled_tokens: int, prefill_tokens: int) -> None:
        """Called once per engine step; the previous step's time is now known."""
        now = self._clock()
        if self._last_step is not None:
            started, tokens = self._last_step
            if tokens >= _MIN_PREFILL_TOKENS:
                self.prefill_seconds_per_token.add((now - started) / tokens)
        self._last_step = (now, prefill_tokens if prefill_tokens == scheduled_tokens else 0)

    def would_load(self, tokens: int, disk_bytes: int, total_bytes: int) -> bool:
        """Whether loading ``total_bytes`` (``disk_bytes`` of them from disk) beats
        recomputing ``tokens``, as far as measured so far."""
        if not self.enabled:
            return True
        prefill = self.prefill_seconds_per_token.value
        host = self.host_seconds_per_byte.value
        disk = self.disk_seconds_per_byte.value if disk_bytes else 0.0
        if prefill is None or host is None or disk is None:
            return True
        return disk * disk_bytes + host * total_bytes < prefill * tokens

    def should_load(self, tokens: int, disk_bytes: int, total_bytes: int) -> bool:
        """``would_load``, counting the hits it turns down (``skipped``)."""
        if self.would_load(tokens, disk_bytes, total_bytes):
            return True
        self.skipped += 1
        return False
