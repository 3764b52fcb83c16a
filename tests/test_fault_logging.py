"""Every failure kind, repeated over many chunks, is counted each time and logged once."""

import errno
import itertools
import logging
import os
import shutil

import pytest

from kvtier import KVStore
from kvtier.disk import tier as disk_module
from kvtier.io.format import HEADER_BYTES
from tests.helpers.disk_helpers import delayed_io, failing_io, remount, small_filesystem
from tests.helpers.faults import flip, slot_of
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.store import STRIDE, config, exact, seq

MANY = 8


def logged(caplog) -> list[str]:
    """kvtier's log lines at WARNING and above."""
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("kvtier") and r.levelno >= logging.WARNING]


def once(caplog, marker: str) -> None:
    lines = logged(caplog)
    assert sum(marker in line for line in lines) == 1, lines
    assert len(lines) == len(set(line.split(":")[0] for line in lines)), f"a kind logged twice: {lines}"


def singles(n=MANY):
    """``n`` one-chunk prefixes with nothing in common."""
    return [seq(1000 * i, 1) for i in range(n)]


def put_all(store, prefixes):
    for tokens in prefixes:
        store.put(tokens, make_kv(tokens))
    store.flush()


@pytest.fixture
def every_other_call_fails(monkeypatch):
    """os.preadv/os.pwritev on slot files fail with EIO on every second call: errors that
    never come three in a row, so the path stays in service and each one is counted."""

    def install(calls):
        counter = itertools.count()
        real = {name: getattr(os, name) for name in calls}

        def wrap(name):
            def call(fd, *args):
                if "slots-" in os.readlink(f"/proc/self/fd/{fd}") and next(counter) % 2 == 0:
                    raise OSError(errno.EIO, "injected I/O error")
                return real[name](fd, *args)
            return call

        for name in calls:
            monkeypatch.setattr(os, name, wrap(name))

    return install


def test_many_corrupt_chunks_in_separate_prefixes(tmp_path, caplog):
    prefixes = singles()
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as store:
        put_all(store, prefixes)
    store = KVStore(SMALL, config(tmp_path, host_chunks=2))
    (data,) = tmp_path.glob("*/writers/*/slots-0000.kvt")
    for tokens in prefixes:
        flip(data, slot_of(store, tokens, 0) * STRIDE + HEADER_BYTES + 7)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert all(exact(store, tokens) == 0 for tokens in prefixes)
    assert store.stats().corruptions == MANY
    once(caplog, "disk read corrupt")
    store.close()


def test_read_errors(tmp_path, caplog, every_other_call_fails):
    prefixes = singles()
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as store:
        put_all(store, prefixes)
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as store, \
            caplog.at_level(logging.WARNING, logger="kvtier"):
        every_other_call_fails(("preadv",))
        served = sum(exact(store, tokens) for tokens in prefixes)
        stats = store.stats()
    assert stats.io_errors == MANY // 2 and served == MANY // 2 * CHUNK
    assert not stats.paths_down
    once(caplog, "disk read io_error")


def test_write_errors(tmp_path, caplog, every_other_call_fails):
    with KVStore(SMALL, config(tmp_path, host_chunks=2 * MANY)) as store, \
            caplog.at_level(logging.WARNING, logger="kvtier"):
        every_other_call_fails(("pwritev",))
        put_all(store, singles())
        stats = store.stats()
        # every chunk's write is tried and counted (neighbours share a call, and a chunk that
        # failed in one is tried again on its own, so which fail depends on the grouping)
        assert stats.io_errors > 0 and stats.disk_writes > 0
        assert stats.io_errors + stats.disk_writes >= MANY
        assert all(exact(store, tokens) == CHUNK for tokens in singles())
    once(caplog, "disk write io_error")


def test_enospc_from_the_write_call(tmp_path, caplog, monkeypatch):
    with KVStore(SMALL, config(tmp_path, host_chunks=2 * MANY)) as store, \
            caplog.at_level(logging.WARNING, logger="kvtier"):
        with failing_io(monkeypatch, "slots-", err=errno.ENOSPC, calls=("pwritev",)):
            put_all(store, singles())
        assert store.stats().no_space == 2 * MANY  # at the put, and again at flush
    once(caplog, "disk write no_space")


def test_a_full_filesystem(caplog):
    with small_filesystem("256k") as fs, caplog.at_level(logging.WARNING, logger="kvtier"), \
            KVStore(SMALL, config(fs, host_chunks=2, disk_chunks=200)) as store:
        put_all(store, singles(40))
        stats = store.stats()
    assert stats.no_space > 1
    once(caplog, "disk write no_space")


def test_the_free_space_floor(tmp_path, caplog):
    with KVStore(SMALL, {**config(tmp_path, host_chunks=2 * MANY), "disk_min_free": "99.9%"}) as store, \
            caplog.at_level(logging.WARNING, logger="kvtier"):
        put_all(store, singles())
        assert store.stats().no_space == 2 * MANY  # at the put, and again at flush
    once(caplog, "disk write no_space")


def test_a_path_that_goes_away(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(disk_module, "_HEALTH_EVERY_S", 0.0)
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as store, \
            caplog.at_level(logging.WARNING, logger="kvtier"):
        put_all(store, singles(2))
        shutil.rmtree(next(tmp_path.iterdir()))
        put_all(store, [seq(50_000 + 1000 * i, 1) for i in range(MANY)])
        assert all(exact(store, tokens) == 0 for tokens in singles(2))
        assert store.stats().paths_down
    once(caplog, "out of service")


def test_a_read_only_path(caplog):
    with small_filesystem("4m") as fs:
        remount(fs, "ro")
        try:
            with caplog.at_level(logging.WARNING, logger="kvtier"), \
                    KVStore(SMALL, config(fs, host_chunks=2)) as store:
                put_all(store, singles())
                assert all(exact(store, tokens) == 0 for tokens in singles()[:-2])
        finally:
            remount(fs, "rw")
    once(caplog, "out of service")


def test_torn_slots_found_at_start(tmp_path, caplog):
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as store:
        put_all(store, singles())
    (data,) = tmp_path.glob("*/writers/*/slots-0000.kvt")
    (index,) = tmp_path.glob("*/writers/*/index.kvt")
    index.unlink()  # recover by the header scan, which reads every header
    for slot in range(MANY):
        flip(data, slot * STRIDE + 40)
    with caplog.at_level(logging.WARNING, logger="kvtier"), \
            KVStore(SMALL, config(tmp_path, host_chunks=2)) as store:
        assert store.stats().torn_slots == MANY and store.stats().recovered_chunks == 0
    once(caplog, "torn slots at start")


def test_write_through_dropped_under_slow_io(tmp_path, caplog, monkeypatch):
    delayed_io(monkeypatch, "pwritev", 0.05)
    with KVStore(SMALL, config(tmp_path, host_chunks=32, io_threads=1)) as store, \
            caplog.at_level(logging.WARNING, logger="kvtier"):
        put_all(store, singles(32))  # a queue of 16 (half the host slots) and slow writes
        assert store.stats().dropped_writes >= 8
        assert all(exact(store, tokens) == CHUNK for tokens in singles(32))
    once(caplog, "write-through dropped")


def test_slow_io_is_served_and_not_a_failure(tmp_path, caplog, monkeypatch):
    prefixes = singles()
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as store:
        put_all(store, prefixes)
    delayed_io(monkeypatch, "preadv", 0.05)
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as store, \
            caplog.at_level(logging.WARNING, logger="kvtier"):
        assert all(exact(store, tokens) == CHUNK for tokens in prefixes)
        stats = store.stats()
    assert stats.disk_reads == MANY and stats.io_errors == stats.corruptions == 0
    assert logged(caplog) == []


def test_the_workers_unexpected_failures_are_logged_once_per_kind(tmp_path, caplog):
    from kvtier.connector.common.messages import ChunkLoad, ChunkStore, RequestLoad, StepPlan
    from tests.helpers.worker_side import BLOCKS, worker

    side, _ = worker(tmp_path, disk=False)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        bad = [ChunkStore(bytes([i]) * 16, (BLOCKS + i, 0), host_slot=i) for i in range(4)]
        side.save(StepPlan(stores=bad))
        side.save(StepPlan(stores=bad))
        for i in range(4):
            load = RequestLoad(f"r{i}", (ChunkLoad(b"h" * 16, (3,), 0, host_slot=10_000),))
            side.start_loads(StepPlan(loads=[load]))
    assert sum(side.report().host_failed.values()) == 8
    side.finished()
    assert side.take_invalid_blocks() == {3}
    lines = logged(caplog)
    assert sum("copy of a chunk to host failed" in line for line in lines) == 1, lines
    assert sum("load failed" in line for line in lines) == 1, lines
    side.close()
