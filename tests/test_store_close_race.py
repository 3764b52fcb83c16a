"""``close()`` while other threads are inside ``put`` and ``get``: every call either finishes
or raises ``StoreClosedError``; close waits for the calls inside before it frees memory."""

import threading
import time
from collections import Counter

import pytest
import torch

from kvtier import KVStore
from kvtier.errors import StoreClosedError
from tests.helpers.disk_helpers import wait_until
from tests.helpers.fake_io import FakeEngine
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, make_kv, same_bytes
from tests.helpers.store import config, seq


def store_config(path, disk: bool) -> dict:
    if disk:
        return config(path, host_chunks=16, disk_chunks=256)
    return {"chunk_tokens": CHUNK, "host_capacity": 16 * CHUNK_BYTES, "model": "m"}


def hammer(store: KVStore, worker: int, go: threading.Event, seen: list[BaseException]) -> None:
    """Put (even workers) or get (odd ones) until the store closes; keep what ended it."""
    tokens = seq(0, 8)
    kv = make_kv(tokens)
    out = torch.zeros_like(kv)
    go.wait()
    try:
        for j in range(100_000):
            if worker % 2:
                n = store.get(tokens, out)
                assert same_bytes(out[:, :, :n], kv[:, :, :n]), "wrong bytes served"
            else:
                fresh = seq(worker * 10**7 + j * 1000, 2)
                store.put(fresh, make_kv(fresh))
        seen.append(AssertionError("the store never closed"))
    except BaseException as exc:
        seen.append(exc)


@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
def test_calls_racing_close_end_in_store_closed_error(tmp_path, disk):
    for trial in range(8):
        root = tmp_path / str(trial)
        root.mkdir()
        store = KVStore(SMALL, store_config(root, disk))
        store.put(seq(0, 8), make_kv(seq(0, 8)))
        go, seen = threading.Event(), []
        workers = [threading.Thread(target=hammer, args=(store, w, go, seen)) for w in range(4)]
        for worker in workers:
            worker.start()
        go.set()
        time.sleep(0.02 * (trial % 4))  # close at different points of the calls
        assert store.close()
        for worker in workers:
            worker.join(timeout=60)
        assert not any(worker.is_alive() for worker in workers), "a call never returned"
        wrong = [repr(exc) for exc in seen if not isinstance(exc, StoreClosedError)]
        assert wrong == [], f"trial {trial}"


def test_close_waits_for_a_get_inside_before_it_frees_memory(tmp_path):
    tokens = seq(0, 2)
    with KVStore(SMALL, config(tmp_path)) as store:
        store.put(tokens, make_kv(tokens))
        assert store.flush()
    make, engines = FakeEngine.factory()
    store = KVStore(SMALL, config(tmp_path), io_engine=make)
    engines[0].hold()  # the get's disk read waits
    loaded: list[int] = []
    out = torch.zeros_like(make_kv(tokens))
    reader = threading.Thread(target=lambda: loaded.append(store.get(tokens, out)))
    reader.start()
    assert engines[0].started.acquire(timeout=30), "the get's read never started"
    closed: list[bool] = []
    closer = threading.Thread(target=lambda: closed.append(store.close()))
    closer.start()
    wait_until(lambda: store._gate.closed, "close never began")  # white-box: the gate
    with pytest.raises(StoreClosedError):
        store.lookup(tokens)  # no call is let in once close has begun
    engines[0].release()
    reader.join(timeout=60)
    closer.join(timeout=60)
    assert loaded == [2 * CHUNK] and same_bytes(out, make_kv(tokens))  # served in full
    assert closed == [True]


def test_two_closes_at_once_close_each_file_once(tmp_path, monkeypatch):
    from kvtier.io import safefs

    plain_close, inside, most = safefs.SafeDir.close, Counter(), [0]

    def watched_close(self) -> None:  # how many threads close one directory at once
        inside[id(self)] += 1
        most[0] = max(most[0], inside[id(self)])
        time.sleep(0.05)
        plain_close(self)
        inside[id(self)] -= 1

    monkeypatch.setattr(safefs.SafeDir, "close", watched_close)
    store = KVStore(SMALL, store_config(tmp_path, disk=True))
    store.put(seq(0, 2), make_kv(seq(0, 2)))
    results: list[object] = []

    def close() -> None:
        try:
            results.append(store.close(10))
        except BaseException as exc:  # an fd closed twice: EBADF, or another thread's file
            results.append(exc)

    closers = [threading.Thread(target=close) for _ in range(2)]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(20)
    assert results == [True, True]
    assert most[0] == 1  # one close at work at a time: no file is closed twice at once


@pytest.mark.parametrize("timeout", [float("inf"), 1e10, -0.5])
def test_close_takes_any_timeout(tmp_path, timeout):
    store = KVStore(SMALL, store_config(tmp_path, disk=True))
    assert store.close(timeout) is True


def _a_get_held_inside(tmp_path, **extra):
    """A store over a cached prefix whose get is inside, its disk read held: (store, the
    held engine, the get's thread)."""
    tokens = seq(0, 2)
    tmp_path.mkdir(exist_ok=True)
    with KVStore(SMALL, config(tmp_path)) as store:
        store.put(tokens, make_kv(tokens))
        assert store.flush()
    make, engines = FakeEngine.factory()
    store = KVStore(SMALL, config(tmp_path, **extra), io_engine=make)
    engines[0].hold()
    out = torch.zeros_like(make_kv(tokens))
    reader = threading.Thread(target=lambda: store.get(tokens, out), daemon=True)
    reader.start()
    assert engines[0].started.acquire(timeout=30)
    return store, engines[0], reader


@pytest.mark.parametrize("timeout", [float("inf"), 1e10])
def test_close_and_flush_wait_without_end_when_told_to(tmp_path, timeout):
    """A timeout past what a lock or a future wait takes (they raise OverflowError) is no
    limit: close waits for the call inside, flush for the writes queued."""
    store, engine, reader = _a_get_held_inside(tmp_path / "close")
    threading.Timer(0.3, engine.release).start()  # the drive answers a moment later
    try:
        assert store.close(timeout) is True
    finally:
        engine.release()
        reader.join(10)
    make, engines = FakeEngine.factory()
    (tmp_path / "flush").mkdir()
    with KVStore(SMALL, config(tmp_path / "flush", write_policy="write_back"),
                 io_engine=make) as store:
        store.put(seq(100, 4), make_kv(seq(100, 4)))
        engines[0].hold()
        threading.Timer(0.3, engines[0].release).start()
        assert store.flush(timeout)


def test_a_second_close_at_once_keeps_to_its_own_timeout(tmp_path):
    """The second of two closes waits for the first within its timeout, then only for what
    is left of it (it gave the calls inside its whole timeout again: twice as long)."""
    store, engine, reader = _a_get_held_inside(tmp_path, load_timeout=30)
    took = {}

    def close(name):
        started = time.monotonic()
        store.close(1.0)
        took[name] = time.monotonic() - started

    try:
        closers = [threading.Thread(target=close, args=(name,)) for name in "ab"]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(30)
        assert max(took.values()) < 1.8, took
    finally:
        engine.release()
        reader.join(10)
        store.close(5)
