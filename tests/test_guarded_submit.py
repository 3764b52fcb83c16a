"""A job a thread pool refused never runs later. ``ThreadPoolExecutor.submit`` queues a job
before it starts a thread for it; when no thread can start (a pids limit) it raises, and a
busy thread of the pool used to run the job once free: a remote put then read a host slot
its owner had given back after being told the put never ran, and stored another chunk's
bytes under its key, with a checksum of those bytes."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvtier.io.guarded import submit_guarded
from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.remote.base import RemoteTier
from kvtier.remote.lane import RemoteLane, RemotePut

RAW = 4096


@pytest.fixture
def no_new_threads(monkeypatch):
    """While ``refuse`` is set, threads whose name starts with one of its prefixes cannot
    start (``RuntimeError``, as under a pids limit)."""
    refuse: list[str] = []
    real = threading.Thread.start

    def start(thread):
        if any(thread.name.startswith(prefix) for prefix in refuse):
            raise RuntimeError("can't start new thread")
        return real(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    return refuse


def busy_pool(prefix: str) -> tuple[ThreadPoolExecutor, threading.Event]:
    """A pool of two threads, its first one started and busy until the event is set."""
    pool, free, busy = ThreadPoolExecutor(2, thread_name_prefix=prefix), threading.Event(), threading.Event()
    pool.submit(lambda: (busy.set(), free.wait(10)))
    assert busy.wait(10)
    return pool, free


@pytest.mark.parametrize("guarded", [True, False])
def test_a_job_whose_submit_raised_never_runs_once_a_thread_is_free(no_new_threads, guarded):
    pool, free = busy_pool("test-pool")
    ran = threading.Event()
    no_new_threads.append("test-pool")
    with pytest.raises(RuntimeError, match="can't start new thread"):
        if guarded:
            submit_guarded(pool, ran.set)
        else:  # what the pool does alone: the job runs later all the same
            pool.submit(ran.set)
    free.set()
    pool.shutdown(wait=True)
    assert ran.is_set() is not guarded


class SlowFirstPut(RemoteTier):
    """A store whose first put waits for ``free``; every put is kept."""

    def __init__(self, free: threading.Event) -> None:
        super().__init__(RAW, 5.0)
        self.free, self.puts, self.entered = free, [], threading.Event()

    def exists(self, keys):
        return [False] * len(keys)

    def get_many(self, keys, dsts):
        return [IOResult(IOStatus.MISSING)] * len(keys)

    def put_many(self, items):
        if not self.puts:
            self.entered.set()
            self.free.wait(10)
        self.puts += [(bytes(k), bytes(v[:8])) for k, v in items]
        return [IOResult(IOStatus.OK, RAW)] * len(items)

    def describe(self):
        return "slow first put"


def test_a_remote_put_the_lane_could_not_start_never_reaches_the_store(no_new_threads):
    free, host, settled = threading.Event(), np.zeros((2, RAW), np.uint8), []
    tier = SlowFirstPut(free)
    lane = RemoteLane(tier, threads=1, payload=lambda slot: host[slot],
                      settle=lambda items, results: settled.append(results))
    a, b = ChunkKey(b"\xaa" * 16), ChunkKey(b"\xbb" * 16)
    host[0], host[1] = 1, 2
    _, group = lane.put(RemotePut(a, 0))
    lane.start(group)
    assert tier.entered.wait(10)  # its job's thread is busy in the first put
    no_new_threads.append("kvtier-remote")
    _, group = lane.put(RemotePut(b, 1))
    with pytest.raises(RuntimeError):
        lane.start(group)
    assert settled == [None]  # told the put never ran: its host slot goes back, and is reused
    host[1] = 9
    free.set()
    assert lane.drain(10)
    assert tier.puts == [(bytes(a), bytes(8 * [1]))]
    assert lane.close(10)
