"""Calls into a store's client that cannot be bounded from outside (Mooncake's: a C++ client
that releases the GIL and runs its own timeouts), each watched by one deadline.

A call runs on one of this object's threads while its caller waits. A call still running
``deadline_s`` after it started is late: ``on_late(what)`` runs at once (the tier goes out of
service, so that the calls queued behind it fail at once instead of each waiting; it is
given ``TimeoutError`` naming the deadline), then

- a call that holds no caller memory (``holds_memory=False``: a lookup) is left to end on its
  own thread, and the caller gets ``None`` within the deadline;
- a call still queued at its deadline (every thread held by late calls) never runs: it is
  failed the same way (``on_late``), so that its caller's None never reads as an answer;
- a call that moves bytes into or out of caller memory (a get, a put) is waited for to its
  end: the transfer engine owns those buffers until the call returns, and a caller that
  reused them sooner could find another transfer's bytes in them. Callers wait on such reads
  with a deadline of their own (``load_timeout``) and free a read's memory only when it
  ends, so the wait here never holds a load; the client's own timeouts end the call.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kvtier.io.guarded import started_pool

T = TypeVar("T")


class WatchedCalls:
    """Run client calls on up to ``threads`` threads, each watched by ``deadline_s``."""

    def __init__(self, deadline_s: float, on_late: Callable[[str, BaseException], Any], threads: int = 16,
                 name: str = "kvtier-remote-call") -> None:
        self.deadline_s = deadline_s
        self._on_late = on_late
        self._pool = started_pool(threads, name)  # none to start later, in a step
        self.late = 0  # calls that ran past their deadline

    def run(self, what: str, call: Callable[[], T], *, holds_memory: bool) -> T | None:
        """``call()``'s answer; None when it holds no memory and ran past the deadline, or
        never ran (still queued at its deadline, or this object closed). An exception
        ``call`` raises is raised here."""
        try:
            future: Future[T] = self._pool.submit(call)
        except RuntimeError:  # closed meanwhile
            return None
        try:
            return future.result(timeout=self.deadline_s)
        except FutureTimeout:
            pass
        except CancelledError:  # closed before it ran
            return None
        if future.cancel():  # still queued behind late calls: it never runs, and no answer
            self._on_late(what, TimeoutError(  # is no "not there" (the tier goes out of service)
                f"not started within {self.deadline_s:g} s (remote_timeout): every call thread "
                "is held by calls past it"))
            return None
        self.late += 1
        self._on_late(what, TimeoutError(f"no answer within {self.deadline_s:g} s (remote_timeout)"))
        if not holds_memory:
            return None
        try:
            return future.result()
        except CancelledError:  # closed before it ran: it holds nothing
            return None

    def close(self) -> None:
        """Take no more calls; those running end on their own threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
