"""The jobs a pool of threads has taken and not finished, for a count and a drain.

A job's owner gives back what the job held (a host slot it read into, a pin, a reservation)
from the callbacks it adds to the job's future. A waiter of a future is told before those
callbacks run (``Future.set_result`` wakes waiters first), so a drain built on
``concurrent.futures.wait`` may return while they still run, and a look for room made just
after it finds none. ``InFlight`` counts a job until it is over and the callbacks of its
future have run: its ``over`` is called then, on the job's own thread for a job that ran,
by ``guarded.cancel`` for one cancelled (``guarded.submit_guarded``). A callback of a job
that drains the pool it ran on would wait for itself: none may.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from functools import partial

from kvtier.units import wait_limit


class InFlight:
    """Jobs taken and not finished, each under a label (a queue's name), or None."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # told as each job finishes
        self._jobs: dict[Future, Hashable] = {}
        self._counts: Counter[Hashable] = Counter()  # jobs not finished, by label

    def add(self, future: Future, label: Hashable = None) -> Callable[[], None]:
        """Count ``future``'s job (not done yet) until it finishes; returns the ``over`` to
        hand to ``submit_guarded`` with it."""
        with self._lock:
            self._jobs[future] = label
            self._counts[label] += 1
        return partial(self._finished, future)

    def _finished(self, future: Future) -> None:
        with self._lock:
            label = self._jobs.pop(future, self)
            if label is not self:  # once, whichever way it ended
                self._counts[label] -= 1
                self._ended.notify_all()

    def count(self, label: Hashable = None) -> int:
        """Jobs not finished: those under ``label``, or all of them (None)."""
        with self._lock:
            return len(self._jobs) if label is None else self._counts[label]

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every job not finished at the call is; True when none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            waiting = set(self._jobs)
            while waiting := {f for f in waiting if f in self._jobs}:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._ended.wait(wait_limit(left))
            return True
