"""Group commit of disk writes: write-through and flush writes of neighbouring slots of one
path go to the disk together (fewer jobs and vectored calls than chunks), each chunk still
finished, counted and failed on its own."""

import errno
import os
import threading
import time

import pytest

from kvtier import KVStore
from kvtier.tiers.base import TierName
from tests.helpers.disk_helpers import wait_until
from tests.helpers.fake_io import FakeEngine
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, bookkeeping, make_kv
from tests.helpers.store import config, exact, seq

HOST, DISK = TierName.HOST, TierName.DISK
STRIDE = 4096 + CHUNK_BYTES


class SlotWrites:
    """``os.pwritev`` on slot files, recorded as (offset, bytes); a call whose range covers a
    slot of ``bad`` fails with ``err`` (a bad sector, or the end of the free space)."""

    def __init__(self, monkeypatch, bad=(), err=errno.EIO) -> None:
        self.calls: list[tuple[int, int]] = []
        self.bad = [slot * STRIDE for slot in bad]
        real, lock = os.pwritev, threading.Lock()

        def call(fd, buffers, offset, *rest):
            if "slots-" in os.readlink(f"/proc/self/fd/{fd}"):
                size = sum(memoryview(b).nbytes for b in buffers)
                with lock:
                    self.calls.append((offset, size))
                if any(offset <= b < offset + size for b in self.bad):
                    raise OSError(err, os.strerror(err))
            return real(fd, buffers, offset, *rest)

        monkeypatch.setattr(os, "pwritev", call)


@pytest.fixture
def fake():
    """``FakeEngine.factory()``; every engine it built is released at the end, so a failing
    test does not leave I/O threads held (the process would wait for them at exit)."""
    make, engines = FakeEngine.factory()
    yield make, engines
    for engine in engines:
        engine.release()


def slots_of(store, tokens) -> list[int | None]:
    with bookkeeping(store) as stack:
        return [stack.indexes[DISK].slot_of(key) for key in store.keys(tokens)]


def held(store) -> tuple[int, int]:
    """(host pins, disk reservations being written)."""
    with bookkeeping(store) as stack:
        return stack.indexes[HOST].census().pins, stack.indexes[DISK].census().writing


def test_neighbouring_chunks_of_one_put_go_to_the_disk_in_fewer_jobs(tmp_path, monkeypatch, fake):
    writes = SlotWrites(monkeypatch)
    make, engines = fake
    tokens = seq(0, 12)
    with KVStore(SMALL, config(tmp_path, host_chunks=16, io_threads=4), io_engine=make) as store:
        engine = engines[0]
        engine.hold("disk0")
        store.put(tokens, make_kv(tokens))
        assert engine.submitted["disk0"] == 2  # two jobs write at once; ten chunks wait for them
        engine.release("disk0")
        assert store.flush(timeout=10)
        stats = store.stats()
        assert stats.disk_writes == 12 and stats.dropped_writes == 0 and stats.io_errors == 0
        assert sorted(slots_of(store, tokens)) == list(range(12))  # neighbouring slots
        assert engine.submitted["disk0"] < 12
    assert len(writes.calls) == 3  # the two first chunks, then the ten that waited: one call
    with KVStore(SMALL, config(tmp_path, host_chunks=16)) as again:
        assert again.stats().recovered_chunks == 12
        assert exact(again, tokens) == 12 * CHUNK


def test_flush_writes_its_batch_in_grouped_jobs(tmp_path, monkeypatch, fake):
    make, engines = fake
    tokens = seq(0, 12)
    cfg = config(tmp_path, host_chunks=16, io_threads=4, write_policy="write_back")
    with KVStore(SMALL, cfg, io_engine=make) as store:
        store.put(tokens, make_kv(tokens))
        assert store.stats().disk_writes == 0  # write-back: nothing evicted, nothing written
        writes, before = SlotWrites(monkeypatch), engines[0].submitted["disk0"]
        flushed = store.flush(timeout=10)
        assert flushed and flushed.written == 12
        # all twelve are queued before a job starts: two jobs, one of them taking the ten that
        # wait (each asks the engine once whether it still runs jobs, with an empty one)
        assert engines[0].submitted["disk0"] - before <= 4
        assert len(writes.calls) == 3
    with KVStore(SMALL, config(tmp_path, host_chunks=16)) as again:
        assert exact(again, tokens) == 12 * CHUNK


@pytest.mark.parametrize(("err", "bad", "counter"), [
    (errno.EIO, [5], "io_errors"),  # one bad sector in the middle of a run
    (errno.ENOSPC, [8, 9, 10, 11], "no_space"),  # room for the first eight only
])
def test_a_failing_call_in_a_group_fails_only_the_chunks_it_concerns(tmp_path, monkeypatch, fake, err, bad,
                                                                     counter):
    SlotWrites(monkeypatch, bad=bad, err=err)
    make, engines = fake
    tokens = seq(0, 12)
    with KVStore(SMALL, config(tmp_path, host_chunks=16, io_threads=4), io_engine=make) as store:
        engines[0].hold("disk0")
        store.put(tokens, make_kv(tokens))
        engines[0].release("disk0")
        assert engines[0].drain(timeout=10)
        stats = store.stats()
        assert getattr(stats, counter) == len(bad) and stats.disk_writes == 12 - len(bad)
        assert not stats.paths_down
        assert [s is None for s in slots_of(store, tokens)] == [i in bad for i in range(12)]
        assert held(store) == (0, 0)
        assert store.lookup(tokens).chunks_by_tier == {HOST: 12}  # nothing lost from host
        flushed = store.flush(timeout=10)  # each tried once more, into the same slots
        assert not flushed and flushed.not_written == len(bad)
        assert getattr(store.stats(), counter) == 2 * len(bad)
    with KVStore(SMALL, config(tmp_path, host_chunks=16)) as again:
        assert again.stats().recovered_chunks == 12 - len(bad)
        assert exact(again, tokens) == bad[0] * CHUNK


def test_a_path_whose_jobs_fail_fails_its_chunks_only(tmp_path, fake):
    paths = [tmp_path / "a", tmp_path / "b"]
    for path in paths:
        path.mkdir()
    make, engines = fake
    tokens = seq(0, 8)
    cfg = config(tmp_path, host_chunks=16, io_threads=4, disk_paths=[str(p) for p in paths],
                 disk_chunks=128)
    with KVStore(SMALL, cfg, io_engine=make) as store:
        engines[0].hold("disk1")
        engines[0].fail(OSError(errno.EIO, "injected"), "disk1")
        store.put(tokens, make_kv(tokens))
        engines[0].release("disk1")
        wait_until(lambda: held(store) == (0, 0), "the failed jobs left chunks held")
        stats = store.stats()
        assert stats.io_errors == 4 and stats.disk_writes == 4  # slots stripe over the paths
        on_disk = slots_of(store, tokens)
        assert all(slot is not None and slot % 2 == 0 for slot in on_disk[0::2])
        assert on_disk[1::2] == [None] * 4


def test_a_hung_group_job_never_blocks_put_and_its_release_finishes_the_reservations(tmp_path, fake):
    make, engines = fake
    store = KVStore(SMALL, config(tmp_path, host_chunks=4, io_threads=4, load_timeout=0.2),
                    io_engine=make)
    engine = engines[0]
    engine.hold("disk0")
    store.put(seq(0, 4), make_kv(seq(0, 4)))  # two jobs hang, two chunks wait behind them
    assert held(store) == (4, 4)  # every host slot pinned by its write
    extra, stored = seq(1000, 1), []
    worker = threading.Thread(target=lambda: stored.append(store.put(extra, make_kv(extra))))
    started = time.monotonic()
    worker.start()
    worker.join(timeout=30)
    assert stored == [0] and time.monotonic() - started < 5  # waited load_timeout, then skipped
    engine.release("disk0")
    wait_until(lambda: held(store) == (0, 0), "the released writes never finished")
    assert store.stats().disk_writes == 4
    assert store.put(extra, make_kv(extra)) == CHUNK
    assert store.close()


def test_writes_past_a_full_queue_are_dropped_and_counted(tmp_path, fake):
    make, engines = fake
    tokens = seq(0, 12)
    with KVStore(SMALL, config(tmp_path, host_chunks=16, io_threads=1), io_engine=make) as store:
        engines[0].hold("disk0")
        store.put(tokens, make_kv(tokens))  # the queue holds 8 chunks (half the host slots):
        assert store.stats().dropped_writes == 4 and engines[0].submitted["disk0"] == 1
        assert held(store) == (8, 8)  # one job, seven waiting
        depth = next(m for m in store.metric_samples() if m.name == "io_queue_depth")
        assert list(depth.values.values()) == [8]  # the job, and the seven chunks behind it
        engines[0].release("disk0")
        flushed = store.flush(timeout=10)
        assert flushed and flushed.written == 4 and store.stats().disk_writes == 12
    with KVStore(SMALL, config(tmp_path, host_chunks=16)) as again:
        assert exact(again, tokens) == 12 * CHUNK


def test_each_path_queues_its_share_of_half_the_host_slots(tmp_path, fake):
    make, engines = fake
    tokens = seq(0, 24)
    paths = [tmp_path / "a", tmp_path / "b"]
    for path in paths:
        path.mkdir(mode=0o700)
    cfg = config(tmp_path, host_chunks=32, io_threads=1, disk_paths=[str(p) for p in paths])
    with KVStore(SMALL, cfg, io_engine=make) as store:
        engines[0].hold()
        store.put(tokens, make_kv(tokens))  # 12 chunks a path, 8 queued on each (32 / 2 / 2)
        assert store.stats().dropped_writes == 8 and held(store) == (16, 16)
        engines[0].release()
        assert store.flush(timeout=10).written == 8 and store.stats().disk_writes == 24


def test_chunks_waiting_on_a_hung_drive_at_close_are_let_go(tmp_path, fake):
    make, engines = fake
    store = KVStore(SMALL, config(tmp_path, host_chunks=8), io_engine=make)
    engines[0].hold()
    store.put(seq(0, 6), make_kv(seq(0, 6)))  # two jobs hang, four chunks wait behind them
    assert store.close(timeout=0.3) is False
    engines[0].release()
    wait_until(lambda: store.stats().disk_writes == 2, "the hung writes never ended")
    wait_until(lambda: held(store) == (0, 0), "the chunks left waiting are still held")
    assert store.stats().io_errors == 0  # never run: not a failure of the disk
    assert store.close()


def test_flush_after_grouped_write_through_keeps_every_chunk_across_a_restart(tmp_path):
    prefixes = [seq(10_000 * i, 6) for i in range(10)]
    with KVStore(SMALL, config(tmp_path, host_chunks=64, disk_chunks=128)) as store:
        for tokens in prefixes:
            store.put(tokens, make_kv(tokens))
        assert store.flush(timeout=30)
        assert store.stats().disk_writes == 60
    with KVStore(SMALL, config(tmp_path, host_chunks=8, disk_chunks=128)) as again:
        assert again.stats().recovered_chunks == 60
        assert all(exact(again, tokens) == 6 * CHUNK for tokens in prefixes)


def test_a_flush_the_closed_engine_refuses_gives_back_every_pin(tmp_path, fake):
    make, engines = fake
    tokens = seq(0, 8)
    store = KVStore(SMALL, config(tmp_path, host_chunks=16, io_threads=2, write_policy="write_back"),
                    io_engine=make)
    store.put(tokens, make_kv(tokens))  # write-back: nothing goes to the disk yet
    engines[0].stop()  # as if the engine had closed meanwhile
    with pytest.raises(RuntimeError):
        store.flush(timeout=10)
    assert held(store) == (0, 0)  # every chunk queued was let go of, none left pinned
    assert exact(store, tokens) == len(tokens)  # still served from host memory
    store.close()
