"""Threads that may not start: a job handed to a thread pool runs only if its submit did
not fail, a pool's threads start with it, and a thread started on demand may be refused.

``ThreadPoolExecutor.submit`` queues a job before it starts a thread for it. When no
thread can start (a cgroup's pids limit, ``RLIMIT_NPROC``, memory) it raises, yet the job
stays queued, and a thread of the pool that frees up runs it later: after its owner was
told it never ran and gave its buffers back, to be filled with other chunks that the job
then reads or writes under its own key. ``submit_guarded`` hands the pool the job wrapped
with a future of its own, cancelled when the submit raises; the wrapper runs the job only
if it can still set that future running (``Future.set_running_or_notify_cancel``).
``start_threads`` starts a pool's threads at once, where a failure fails the owner's start
(the engine's) rather than a later step; ``start_thread`` starts one on demand and says
whether it could, for the caller to go without it (a step of vLLM must never raise).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

log = logging.getLogger("kvtier")
JOIN_S = 30.0  # how long the threads of a pool starting may take to reach their first job
_refused = threading.Event()  # a thread was refused: said once a process
# a future's waiters are told once: one cancel, or one start, at a time (reentrant: a
# cancel's done callbacks run under it, and may cancel or submit in turn)
_cancelling = threading.RLock()
_overs: dict[Future, Callable[[], Any]] = {}  # a guarded job's ``over``, until it is called
_overs_lock = threading.Lock()


def submit_guarded(pool: ThreadPoolExecutor, job: Callable[..., Any], *args: Any,
                   future: Future | None = None, over: Callable[[], Any] | None = None) -> Future:
    """``job(*args)`` submitted to ``pool``, settling ``future`` (a new one when None),
    which is returned. Re-raises what the submit raised, the job then never run; a job
    cancelled in the pool's queue (a shutdown that cancels what waits) cancels the future.
    ``over``, when given, is called once the job is over and the callbacks of its future
    have run (a waiter of the future is told before they run): on the pool's thread after
    a job that ran, by ``cancel`` after one cancelled."""
    future = Future() if future is None else future
    if over is not None:
        with _overs_lock:
            _overs[future] = over
    try:
        queued = pool.submit(run_into, future, partial(job, *args))
    except BaseException:
        if cancel(future):  # the job never runs, even if the pool queued it
            raise
        return future  # a thread took it meanwhile: it ends as any job does
    queued.add_done_callback(lambda q: cancel(future) if q.cancelled() else None)
    return future


def cancel(future: Future) -> bool:
    """Cancel ``future`` unless it runs or ran, and tell its waiters at once: ``wait``
    counts a future cancelled as done only once told, and a plain ``Future.cancel`` leaves
    that to the thread that would have run it, which a job queued behind a hung one never
    gets to. True when cancelled (now, or before). Every cancel of a guarded job's future
    goes through here."""
    with _cancelling:
        if future.cancelled():  # cancelled here before: told then
            return True
        if not future.cancel():
            return False
        future.set_running_or_notify_cancel()
    _over(future)  # after its callbacks, which ``Future.cancel`` ran
    return True


def run_into(future: Future, job: Callable[[], Any]) -> None:
    """Run ``job`` into ``future``, unless the future was cancelled first; then its ``over``."""
    with _cancelling:  # not between a cancel and its telling (told twice: RuntimeError)
        cancelled = future.cancelled() or not future.set_running_or_notify_cancel()
    if cancelled:  # its callbacks ran at the cancel (a plain ``Future.cancel`` too): over
        _over(future)
        return
    try:
        result = job()
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)  # its callbacks run here, on this thread
    finally:
        _over(future)


def _over(future: Future) -> None:
    """Call the ``over`` ``submit_guarded`` was given for ``future``, once."""
    with _overs_lock:
        over = _overs.pop(future, None)
    if over is not None:
        over()


def start_threads(pool: ThreadPoolExecutor, count: int) -> None:
    """Start all ``count`` threads of ``pool`` now: each of ``count`` jobs holds its thread
    until every one has one (the pool starts a thread for a job no idle thread takes).
    Raises when one cannot start; the pool is then shut down."""
    started = threading.Barrier(count + 1)
    try:
        for _ in range(count):
            pool.submit(started.wait, JOIN_S)
        started.wait(JOIN_S)
    except BaseException:
        started.abort()  # the threads started let go at once
        pool.shutdown(wait=False, cancel_futures=True)
        raise


def started_pool(threads: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``threads`` threads named ``name``, every one started (``start_threads``)."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
    start_threads(pool, threads)
    return pool


def start_thread(thread: threading.Thread) -> bool:
    """Start ``thread``; False when no thread can start now (``RuntimeError``: a pids limit,
    ``RLIMIT_NPROC``, memory), said once a process: the caller goes without it this time."""
    try:
        thread.start()
    except RuntimeError as exc:
        if not _refused.is_set():
            _refused.set()
            log.warning("kvtier: a thread (%s) could not start (%s): what it was for waits for "
                        "a later try (further refusals are not logged)", thread.name, exc)
        return False
    return True
