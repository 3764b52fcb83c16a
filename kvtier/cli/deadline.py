"""One deadline for a whole command: ``--timeout`` bounds everything it does (reading an
endpoint, parsing what came back, printing it), not one step of it.

The steps that can take long check the deadline as they go (``Deadline.check``, cheap
enough for every few thousand lines); when it has passed they raise ``DeadlineExpired``
saying what was being done and how far it got, and the command ends on that one line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


class DeadlineExpired(TimeoutError):
    """``--timeout`` ran out; the message says while doing what, and how far it got."""


@dataclass(frozen=True)
class Deadline:
    """``seconds`` from when it was made, ending at ``at`` by ``clock`` (``time.monotonic``
    unless a test gives another)."""

    seconds: float
    at: float
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def after(cls, seconds: float, clock: Callable[[], float] = time.monotonic) -> Deadline:
        return cls(seconds, clock() + seconds, clock)

    def left(self) -> float:
        """Seconds left (0 once it has passed)."""
        return max(0.0, self.at - self.clock())

    def check(self, doing: str) -> None:
        """Raise ``DeadlineExpired`` when the deadline has passed (``doing``: what the
        command was doing, and how far it got, for the message)."""
        if self.clock() >= self.at:
            raise DeadlineExpired(f"--timeout {self.seconds:g} s ran out {doing}; give a longer "
                                  "--timeout")
