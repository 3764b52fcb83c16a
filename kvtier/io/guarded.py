"""A job handed to a thread pool runs only if its submit did not fail.

``ThreadPoolExecutor.submit`` queues a job before it starts a thread for it. When no
thread can start (a cgroup's pids limit, ``RLIMIT_NPROC``, memory) it raises, yet the job
stays queued, and a thread of the pool that frees up runs it later: after its owner was
told it never ran and gave its buffers back, to be filled with other chunks that the job
then reads or writes under its own key. ``submit_guarded`` hands the pool the job wrapped
with a future of its own, cancelled when the submit raises; the wrapper runs the job only
if it can still set that future running (``Future.set_running_or_notify_cancel``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any


def submit_guarded(pool: ThreadPoolExecutor, job: Callable[..., Any], *args: Any,
                   future: Future | None = None) -> Future:
    """``job(*args)`` submitted to ``pool``, settling ``future`` (a new one when None),
    which is returned. Re-raises what the submit raised, the job then never run; a job
    cancelled in the pool's queue (a shutdown that cancels what waits) cancels the future."""
    future = Future() if future is None else future
    try:
        queued = pool.submit(run_into, future, partial(job, *args))
    except BaseException:
        if future.cancel():  # the job never runs, even if the pool queued it
            raise
        return future  # a thread took it meanwhile: it ends as any job does
    queued.add_done_callback(lambda q: future.cancel() if q.cancelled() else None)
    return future


def run_into(future: Future, job: Callable[[], Any]) -> None:
    """Run ``job`` into ``future``, unless the future was cancelled first."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = job()
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)
