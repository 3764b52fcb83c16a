"""Jobs that may block on a file system that stops answering (a hung network mount), run
at once each on a daemon thread of its own and waited for until a deadline: what is not over
by then is left running, and the caller goes on without it.

Used where a start must not wait for ever: opening each disk path (its lock, lease, seat
and O_DIRECT probe, after its file system answered: ``kvtier.io.answers``), and reading back
what each holds. A path whose open or read-back is not over within
``path_job_wait(load_timeout)`` starts out of service and is tried again later; the wait is
generous (a read of a large index on a network file system, a scan of every slot header
where an index is missing, are slow but move), since what is left behind costs the chunks
on that path until its next try.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

from kvtier.io.guarded import start_thread

PATH_JOB_TIMES = 6  # a path's open or read-back at start is given this many load_timeouts
PATH_JOB_MIN_S = 30.0  # and never less than this

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def path_job_wait(timeout: float | None) -> float | None:
    """How long a start waits for a disk path's open or read-back, for ``load_timeout``
    ``timeout`` (None: as long as it takes)."""
    return None if timeout is None else max(PATH_JOB_MIN_S, PATH_JOB_TIMES * timeout)


def run_bounded(jobs: Mapping[K, Callable[[], T]], wait: float | None, name: str,
                left_over: Callable[[K, T | BaseException], None] | None = None,
                ) -> dict[K, T | BaseException]:
    """Run every job at once, each on a daemon thread named ``name``, and return, by key,
    what each that ended within ``wait`` seconds (None: as long as they take) returned or
    raised; a job not over then is missing, and goes on running (it must not touch what the
    caller keeps). What such a job returns or raises once it ends is handed to
    ``left_over(key, outcome)`` on its thread (to close what it opened: nobody else ever
    sees it). A job whose thread cannot start runs on the caller's thread."""
    done: dict[K, T | BaseException] = {}
    over = threading.Condition()
    taken = False  # the caller went on: what ends from now on is left over

    def run(key: K, job: Callable[[], T]) -> None:
        try:
            result: T | BaseException = job()
        except BaseException as exc:  # handed to the caller, who decides
            result = exc
        with over:
            late = taken
            if not late:
                done[key] = result
                over.notify_all()
        if late and left_over is not None:
            left_over(key, result)

    for key, job in jobs.items():
        if not start_thread(threading.Thread(target=run, args=(key, job), name=name, daemon=True)):
            run(key, job)
    deadline = None if wait is None else time.monotonic() + wait
    with over:
        while len(done) < len(jobs):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            over.wait(left)
        taken = True
        return dict(done)
