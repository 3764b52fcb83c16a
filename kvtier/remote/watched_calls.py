"""Calls into a store's client that cannot be bounded from outside (Mooncake's: a C++ client
that releases the GIL and runs its own timeouts), each watched by one deadline.

A call runs on one of this object's threads while its caller waits. A call still running
``deadline_s`` after it started is late: ``on_late(what)`` runs at once (the tier goes out of
service, so that the calls queued behind it fail at once instead of each waiting; it is
given ``TimeoutError`` naming the deadline), then

- a call that holds no caller memory (``holds_memory=False``: a lookup) is left to end on its
  own thread, and the caller gets ``None`` within the deadline;
- a call still queued at its deadline never runs. Where a thread is held by a call past its
  own deadline (the store is late), it is failed the same way (``on_late``), so that its
  caller's None never reads as an answer. Where every thread is busy with calls still
  within theirs (a healthy store under load), the store is not blamed: ``CallsBusy`` is
  raised for that call alone;
- a call that started after some time queued has its own deadline from its start (time
  queued is not the store's): its caller waits less than two deadlines in all;
- a call that moves bytes into or out of caller memory (a get, a put) is waited for to its
  end: the transfer engine owns those buffers until the call returns, and a caller that
  reused them sooner could find another transfer's bytes in them. Callers wait on such reads
  with a deadline of their own (``load_timeout``) and free a read's memory only when it
  ends, so the wait here never holds a load; the client's own timeouts end the call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

from kvtier.io.guarded import started_pool

T = TypeVar("T")
log = logging.getLogger("kvtier")
CLOSE_WAIT_S = 10.0  # the longest closing waits for calls still running before closing the client


class CallsBusy(TimeoutError):
    """A call still queued at its deadline, every call thread busy with calls within theirs
    (none past it): that call fails, and the store is not to blame."""


class _Running:
    """When one call started running (None: not yet)."""

    def __init__(self) -> None:
        self.started: float | None = None

    def run(self, call: Callable[[], T]) -> T:
        self.started = time.monotonic()
        return call()


class WatchedCalls:
    """Run client calls on up to ``threads`` threads, each watched by ``deadline_s``."""

    def __init__(self, deadline_s: float, on_late: Callable[[str, BaseException], Any], threads: int = 16,
                 name: str = "kvtier-remote-call") -> None:
        self.deadline_s = deadline_s
        self._on_late = on_late
        self._pool = started_pool(threads, name)  # none to start later, in a step
        self._lock = threading.Lock()
        self._running: dict[Future, _Running] = {}  # calls submitted and not over (late too)
        self.late = 0  # calls that ran past their deadline

    def run(self, what: str, call: Callable[[], T], *, holds_memory: bool) -> T | None:
        """``call()``'s answer; None when it holds no memory and ran past its deadline, or
        never ran (still queued behind late calls at its deadline, or this object closed).
        ``CallsBusy`` for a call still queued at its deadline behind calls within theirs. An
        exception ``call`` raises is raised here."""
        running = _Running()
        with self._lock:  # listed before its end can unlist it
            try:
                future: Future[T] = self._pool.submit(running.run, call)
            except RuntimeError:  # closed meanwhile
                return None
            self._running[future] = running
        future.add_done_callback(self._over)
        try:
            return future.result(timeout=self.deadline_s)
        except FutureTimeout:
            pass
        except CancelledError:  # closed before it ran
            return None
        if future.cancel():  # still queued: it never runs
            self._unstarted(what)
            return None
        started = running.started or time.monotonic()  # running, its start not noted yet
        try:  # its own deadline counts from its start: time queued is not the store's
            return future.result(timeout=max(0.0, started + self.deadline_s - time.monotonic()))
        except FutureTimeout:
            pass
        self.late += 1
        self._on_late(what, TimeoutError(f"no answer within {self.deadline_s:g} s (remote_timeout)"))
        if not holds_memory:
            return None
        return future.result()

    def _unstarted(self, what: str) -> None:
        """A call cancelled while queued at its deadline: the tier hears of it where a call
        past its own deadline holds a thread; ``CallsBusy`` where none does."""
        now = time.monotonic()
        with self._lock:
            late = [f for f, r in self._running.items() if not f.done()
                    and r.started is not None and now - r.started >= self.deadline_s]
        if not late:
            raise CallsBusy(f"{what}: not started within {self.deadline_s:g} s (remote_timeout): "
                            "every call thread busy with calls within it")
        self._on_late(what, TimeoutError(  # no answer is no "not there": the tier goes out
            f"not started within {self.deadline_s:g} s (remote_timeout): every call thread "
            "is held by calls past it"))

    def _over(self, future: Future) -> None:
        with self._lock:
            self._running.pop(future, None)

    def close(self, release: Callable[[], Any] | None = None) -> bool:
        """Take no more calls, wait up to three deadlines (``CLOSE_WAIT_S`` at most, a second
        at least) for those running (late ones too: they may still call into the client),
        then ``release()`` (close the client; its errors are dropped) only when none is
        left: a call into a closed client crashes the process. True when none was left."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            running = list(self._running.keys())
        wait_s = min(CLOSE_WAIT_S, max(1.0, 3 * self.deadline_s))
        over = not wait_futures(running, timeout=wait_s).not_done
        if not over:
            log.warning("kvtier: remote calls still running %g s after the tier closed (a late "
                        "call): its client is left open until the process exits", wait_s)
        elif release is not None:
            with contextlib.suppress(Exception):  # a master gone: nothing more to release
                release()
        return over
