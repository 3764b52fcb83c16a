"""A job a thread pool refused never runs later, and the remote lane's threads all start
with it. ``ThreadPoolExecutor.submit`` queues a job before it starts a thread for it; when
no thread can start (a pids limit) it raises, and a busy thread of the pool used to run the
job once free: a remote put then read a host slot its owner had given back after being told
the put never ran, and stored another chunk's bytes under its key, with a checksum of those
bytes."""

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


class Store(RemoteTier):
    """A store that keeps every put."""

    def __init__(self) -> None:
        super().__init__(RAW, 5.0)
        self.puts: list[bytes] = []

    def exists(self, keys):
        return [False] * len(keys)

    def get_many(self, keys, dsts):
        return [IOResult(IOStatus.MISSING)] * len(keys)

    def put_many(self, items):
        self.puts += [bytes(k) for k, _ in items]
        return [IOResult(IOStatus.OK, RAW)] * len(items)

    def describe(self):
        return "kept"


def lane_of(store: RemoteTier) -> RemoteLane:
    host = np.zeros((8, RAW), np.uint8)
    return RemoteLane(store, threads=2, payload=lambda slot: host[slot], settle=lambda *_: None)


def test_a_remote_lane_starts_its_threads_with_it_and_none_in_a_step(no_new_threads):
    """Its puts and reads never start a thread (one refused then would fail a step), and
    a lane whose threads cannot start fails its own start, cleanly."""
    store = Store()
    lane = lane_of(store)
    no_new_threads.append("kvtier-remote")
    keys = [ChunkKey(bytes([i]) * 16) for i in range(8)]
    for i, key in enumerate(keys):
        _, group = lane.put(RemotePut(key, i))
        lane.start(group)
    reads = [lane.submit(lambda: store.get_many(keys, [None] * 8)) for _ in range(8)]
    assert lane.drain(10) and all(r.result()[0].status is IOStatus.MISSING for r in reads)
    assert sorted(store.puts) == sorted(bytes(k) for k in keys)
    assert lane.close(10)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        lane_of(Store())
