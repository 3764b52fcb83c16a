"""Disk faults: the store keeps serving, counts the fault, and never returns a wrong byte."""

import errno
import logging
import os
import shutil
import threading
import time

import pytest

from kvtier import KVStore
from kvtier.disk import tier as disk_module
from kvtier.io.format import HEADER_BYTES
from tests.helpers.disk_helpers import failing_io, remount, small_filesystem, wait_until
from tests.helpers.fake_io import FakeEngine
from tests.helpers.faults import flip, slot_of, stored
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, bookkeeping, index_of, make_kv
from tests.helpers.store import STRIDE, config, exact, seq


def test_a_flipped_payload_byte_ends_the_prefix_there(tmp_path, caplog):
    store, tokens = stored(tmp_path)
    slot = slot_of(store, tokens, 3)
    (data,) = tmp_path.glob("*/writers/*/slots-0000.kvt")
    flip(data, slot * STRIDE + HEADER_BYTES + 1234)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert exact(store, tokens) == 3 * CHUNK
        assert exact(store, tokens) == 3 * CHUNK  # the bad chunk is gone, not re-read
    stats = store.stats()
    assert stats.corruptions == 1
    assert store.lookup(tokens).tokens == 3 * CHUNK
    assert sum("corrupt" in r.message for r in caplog.records) == 1
    store.close()
    with KVStore(SMALL, config(tmp_path)) as again:  # blanked: not recovered again
        assert again.stats().recovered_chunks == 5


def test_a_flipped_header_byte_is_caught(tmp_path):
    store, tokens = stored(tmp_path)
    (data,) = tmp_path.glob("*/writers/*/slots-0000.kvt")
    flip(data, slot_of(store, tokens, 0) * STRIDE + 50)
    assert exact(store, tokens) == 0
    assert store.stats().corruptions == 1
    store.close()


def test_truncated_slot_file_gives_misses(tmp_path):
    store, tokens = stored(tmp_path)
    store.close()
    (data,) = tmp_path.glob("*/writers/*/slots-0000.kvt")
    os.truncate(data, 2 * STRIDE + 100)
    with KVStore(SMALL, config(tmp_path)) as store:
        n = exact(store, tokens)
        assert n < 6 * CHUNK
        assert store.stats().corruptions + store.stats().torn_slots >= 1


def test_read_errors_are_counted_then_the_path_is_taken_out(tmp_path, monkeypatch, caplog):
    singles = [seq(i * 1000, 1) for i in range(5)]
    with KVStore(SMALL, config(tmp_path, host_chunks=8)) as store:
        for tokens in singles:
            store.put(tokens, make_kv(tokens))
        store.flush()
    store = KVStore(SMALL, config(tmp_path, host_chunks=8))
    with failing_io(monkeypatch, "slots-", calls=("preadv",)):
        for tokens in singles:
            assert exact(store, tokens) == 0
    stats = store.stats()
    assert stats.io_errors == 2  # the third error in a row takes the path out
    assert list(stats.paths_down) == [str(tmp_path)]
    assert all(store.lookup(tokens).tokens == 0 for tokens in singles)
    later = seq(500, 2)
    store.put(later, make_kv(later))  # host memory still serves
    assert exact(store, later) == 2 * CHUNK
    store.close()


def test_write_errors_are_counted_and_serving_goes_on(tmp_path, monkeypatch):
    with KVStore(SMALL, config(tmp_path, host_chunks=16)) as store:
        with failing_io(monkeypatch, "slots-", calls=("pwritev",)):
            store.put(seq(0, 2), make_kv(seq(0, 2)))
            assert store.flush().not_written == 2
        stats = store.stats()
        # 2 at the put; flush tries both again, and the third error in a row takes the path
        # out (counted there, not as an I/O error); a retry already running then fails on
        # its own (3)
        assert stats.io_errors in (2, 3) and stats.disk_writes == 0 and stats.paths_down
        assert exact(store, seq(0, 2)) == 2 * CHUNK


def test_two_paths_one_failing(tmp_path, monkeypatch):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir(mode=0o700)
    bad.mkdir(mode=0o700)
    cfg = {**config(good, host_chunks=2), "disk_paths": [str(good), str(bad)]}
    tokens = seq(0, 10)
    with KVStore(SMALL, cfg) as store:
        with failing_io(monkeypatch, str(bad) + "/"):
            store.put(tokens, make_kv(tokens))
            store.flush()
            for i in range(10):
                exact(store, seq(1000 * i, 1) if i else tokens)
        stats = store.stats()
        assert list(stats.paths_down) == [str(bad)]
        assert stats.disk_writes >= 4  # the good path took its share
        later = seq(5000, 6)
        store.put(later, make_kv(later))
        store.flush()
        assert exact(store, later) == 6 * CHUNK
        assert store.lookup(later).tokens == 6 * CHUNK


def test_enospc_on_a_full_filesystem(tmp_path):
    with small_filesystem("256k") as fs:
        cfg = config(fs, host_chunks=2, disk_chunks=200)
        with KVStore(SMALL, cfg) as store:
            for i in range(40):
                store.put(seq(i * 100, 1), make_kv(seq(i * 100, 1)))
            store.flush()
            stats = store.stats()
            assert stats.no_space > 0 and stats.disk_writes > 0
            assert not stats.paths_down
            for i in range(40):
                exact(store, seq(i * 100, 1))


def test_free_space_floor_stops_writes_before_the_disk_fills(tmp_path):
    with KVStore(SMALL, {**config(tmp_path), "disk_min_free": "99.9%"}) as store:
        store.put(seq(0, 3), make_kv(seq(0, 3)))
        store.flush()
        stats = store.stats()
        assert stats.no_space == 2 * 3 and stats.disk_writes == 0  # at the put, again at flush
        assert not list(tmp_path.glob("*/writers/*/slots-*.kvt")) or all(
            f.stat().st_size == 0 for f in tmp_path.glob("*/writers/*/slots-*.kvt"))


def test_a_read_only_path_is_taken_out(tmp_path):
    with small_filesystem("4m") as fs:
        remount(fs, "ro")
        try:
            with KVStore(SMALL, config(fs, host_chunks=4)) as store:
                assert "Read-only" in store.stats().paths_down[str(fs)]
                store.put(seq(0, 2), make_kv(seq(0, 2)))
                assert exact(store, seq(0, 2)) == 2 * CHUNK
        finally:
            remount(fs, "rw")


def test_a_vanished_directory_is_taken_out(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_module, "_HEALTH_EVERY_S", 0.0)
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as store:
        store.put(seq(0, 2), make_kv(seq(0, 2)))
        store.flush()
        shutil.rmtree(next(tmp_path.iterdir()))
        store.put(seq(100, 3), make_kv(seq(100, 3)))
        store.flush()
        assert "directory gone" in store.stats().paths_down[str(tmp_path)]
        exact(store, seq(100, 3))


def test_a_symlinked_disk_path_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with KVStore(SMALL, config(link)) as store:
        assert "symlink" in store.stats().paths_down[str(link)]
        store.put(seq(0, 2), make_kv(seq(0, 2)))
        assert exact(store, seq(0, 2)) == 2 * CHUNK
    assert list(real.iterdir()) == []


def test_a_world_writable_disk_path_is_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with KVStore(SMALL, config(open_dir)) as store:
        assert "world-writable" in store.stats().paths_down[str(open_dir)]


def test_a_missing_disk_path_is_named(tmp_path):
    with KVStore(SMALL, config(tmp_path / "nope")) as store:
        assert "does not exist" in store.stats().paths_down[str(tmp_path / "nope")]


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES])
def test_fatal_errors_take_the_path_out_at_once(tmp_path, monkeypatch, err):
    with KVStore(SMALL, config(tmp_path, host_chunks=8)) as store:
        with failing_io(monkeypatch, "slots-", err=err, calls=("pwritev",)):
            store.put(seq(0, 1), make_kv(seq(0, 1)))
            store.flush()
        assert str(tmp_path) in store.stats().paths_down


def test_enospc_from_the_write_call_is_a_failed_store(tmp_path, monkeypatch):
    with KVStore(SMALL, config(tmp_path, host_chunks=8)) as store:
        with failing_io(monkeypatch, "slots-", err=errno.ENOSPC, calls=("pwritev",)):
            store.put(seq(0, 3), make_kv(seq(0, 3)))
            store.flush()
        stats = store.stats()
        assert stats.no_space == 2 * 3 and stats.disk_writes == 0 and not stats.paths_down
        assert exact(store, seq(0, 3)) == 3 * CHUNK
        store.put(seq(100, 2), make_kv(seq(100, 2)))  # space came back: writes go on
        assert store.flush()  # and flush writes the three that failed before too
        assert store.stats().disk_writes == 2 + 3


def test_a_path_taken_out_is_tried_again_and_comes_back(tmp_path, monkeypatch, caplog):
    with KVStore(SMALL, config(tmp_path, host_chunks=2, disk_retry=0.001)) as store, \
            caplog.at_level(logging.WARNING, logger="kvtier"):
        with failing_io(monkeypatch, "slots-", err=errno.EROFS, calls=("pwritev",)):
            store.put(seq(0, 1), make_kv(seq(0, 1)))
            store.flush()
            assert str(tmp_path) in store.stats().paths_down
        time.sleep(0.01)  # past disk_retry
        later = seq(50_000, 3)
        store.put(later, make_kv(later))  # tried again in the background
        store.flush()
        # back at least once: a retry due while the writes still failed may have revived
        # it (reopening needs no write) before the next write took it out again
        assert not store.stats().paths_down and store.stats().paths_back >= 1
        store.put(seq(60_000, 3), make_kv(seq(60_000, 3)))
        store.flush()
        assert store.stats().disk_writes >= 3
        assert any("back in service" in r.getMessage() for r in caplog.records)
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as again:
        assert exact(again, seq(60_000, 3)) == 3 * CHUNK  # written after it came back


def test_a_path_still_failing_is_tried_less_and_less_often(tmp_path, monkeypatch):
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as store:
        with failing_io(monkeypatch, "slots-", err=errno.EROFS, calls=("pwritev",)):
            store.put(seq(0, 1), make_kv(seq(0, 1)))
            store.flush()
        disk = store.disk
        assert disk.revive_due() == []  # not before its first retry time
        monkeypatch.setattr(time, "monotonic", lambda: 1e12)
        assert disk.revive_due() == [0]
        monkeypatch.setattr(disk_module.CacheDir, "__init__", lambda *a, **k: (_ for _ in ()).throw(
            OSError(errno.EIO, "still failing")))
        assert disk.revive(0) is False
        assert disk.paths[0].retry_every == 60  # from disk_retry's default 30 s
        assert disk.revive_due() == []


def test_disk_retry_off_leaves_a_path_out(tmp_path, monkeypatch):
    with KVStore(SMALL, config(tmp_path, disk_retry="off")) as store:
        with failing_io(monkeypatch, "slots-", err=errno.EROFS, calls=("pwritev",)):
            store.put(seq(0, 1), make_kv(seq(0, 1)))
            store.flush()
        monkeypatch.setattr(time, "monotonic", lambda: 1e12)
        assert store.disk.revive_due() == [] and store.disk.revive(0) is False


def test_a_second_store_gets_the_disk_once_the_first_is_gone(tmp_path):
    first = KVStore(SMALL, config(tmp_path, instance_id="node-a"))
    second = KVStore(SMALL, config(tmp_path, disk_retry=0.001, instance_id="node-a"))
    assert "in use" in second.stats().paths_down[str(tmp_path)]
    first.close()
    time.sleep(0.01)  # past disk_retry
    tokens = seq(0, 2)
    second.put(tokens, make_kv(tokens))  # tries the path again (read back on a thread of its own)
    wait_until(lambda: second.lookup(seq(900, 1)) is not None and not second.stats().paths_down,
               "the path never came back")
    second.put(seq(100, 2), make_kv(seq(100, 2)))
    second.flush()
    assert not second.stats().paths_down and second.stats().disk_writes >= 2
    second.close()


def test_a_hung_disk_read_is_given_up_after_load_timeout(tmp_path, caplog):
    tokens, others = seq(0, 4), [seq(1000 * i, 1) for i in range(1, 3)]
    with KVStore(SMALL, config(tmp_path, host_chunks=8)) as store:
        for prefix in [tokens, *others]:
            store.put(prefix, make_kv(prefix))
        store.flush()
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, config(tmp_path, host_chunks=8, load_timeout=0.2), io_engine=make) as store, \
            caplog.at_level(logging.WARNING, logger="kvtier"):
        host = index_of(store, disk_module.TierName.HOST)
        engines[0].hold()  # a drive that does not answer
        started = time.monotonic()
        assert exact(store, tokens) == 0  # the first chunk's read hangs: nothing to serve
        assert time.monotonic() - started < 5
        assert store.stats().load_timeouts == 1
        assert host.free_slots < 8  # the hung reads' slots stay reserved
        started = time.monotonic()
        store.put(tokens, make_kv(tokens))  # computed again and stored: no wait on the hung reads
        assert time.monotonic() - started < 5
        for prefix in others:  # two more reads without an answer: the path is taken out
            assert exact(store, prefix) == 0
        assert store.stats().load_timeouts == 3 and str(tmp_path) in store.stats().paths_down
        engines[0].release()
        store.flush()
        # given back once the reads ended (their callbacks ran); reads no longer wait now
        wait_until(lambda: host.reusable_slots == 8, "the hung reads' slots were never given back")
        later = seq(10_000, 2)
        store.put(later, make_kv(later))
        assert exact(store, later) == 2 * CHUNK
    assert sum("timed_out" in r.getMessage() for r in caplog.records) == 1


def test_close_on_a_hung_drive_returns_in_time_and_keeps_what_the_io_uses(tmp_path, caplog):
    make, engines = FakeEngine.factory()
    store = KVStore(SMALL, config(tmp_path, host_chunks=8), io_engine=make)
    engines[0].hold()
    tokens = seq(0, 6)
    store.put(tokens, make_kv(tokens))  # write-through: 2 writes hang, 4 wait behind them
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        assert store.close(timeout=0.3) is False
    assert time.monotonic() - started < 5
    assert any("hung drive" in r.getMessage() for r in caplog.records)
    assert not store.disk.paths[0].dir.closed  # a late write still uses its file
    assert store.tiers[disk_module.TierName.HOST].buffer.array is not None  # and its host slot
    engines[0].release()  # the two running writes end; the four queued behind them never start
    wait_until(lambda: store.stats().disk_writes == 2, "the hung writes never ended")
    assert engines[0].pending() == 0
    assert store.close()  # nothing runs any more: memory and files go now
    assert store.disk.paths[0].dir.closed


def test_a_write_back_move_on_a_hung_drive_is_given_up_after_load_timeout(tmp_path, caplog):
    first, second = seq(0, 2), seq(1000, 1)
    make, engines = FakeEngine.factory()
    store = KVStore(SMALL, config(tmp_path, host_chunks=2, write_policy="write_back",
                                  load_timeout=0.2), io_engine=make)
    host = index_of(store, disk_module.TierName.HOST)
    store.put(first, make_kv(first))  # host full; nothing on disk yet
    engines[0].hold()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert store.put(second, make_kv(second)) == 0  # its host slot's chunk never reached disk
    assert time.monotonic() - started < 5
    stats = store.stats()
    assert stats.load_timeouts == 1 and stats.chunks_stored == 2
    assert sum("write-back timed_out" in r.getMessage() for r in caplog.records) == 1
    assert host.reusable_slots == 1  # the victim's slot stays taken while the write reads it
    assert store.lookup(first).tokens == 0  # the victim (the first chunk) is not visible yet
    engines[0].release()
    wait_until(lambda: host.reusable_slots == 2, "the slot was never given back")
    assert store.stats().disk_writes == 1
    assert store.put(second, make_kv(second)) == CHUNK  # the drive answers again
    assert exact(store, second) == CHUNK and exact(store, first) == 2 * CHUNK
    assert store.close()


def test_a_get_whose_staging_slot_cannot_be_written_back_ends_its_prefix(tmp_path):
    first, second = seq(0, 2), seq(1000, 2)
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, config(tmp_path, host_chunks=2, write_policy="write_back",
                               load_timeout=0.2), io_engine=make) as store:
        store.put(first, make_kv(first))
        store.put(second, make_kv(second))  # the first prefix moves to disk, within put
        assert store.lookup(first).chunks_by_tier == {disk_module.TierName.DISK: 2}
        engines[0].hold()
        started = time.monotonic()
        assert exact(store, first) == 0  # staging it needs the second prefix written back
        assert time.monotonic() - started < 5 and store.stats().load_timeouts == 1
        engines[0].release()
        store.flush()
        assert engines[0].drain(10), "the write never ended"
        assert exact(store, first) == 2 * CHUNK  # still cached, and served once the drive answers
        assert exact(store, second) == 2 * CHUNK


def test_a_path_that_holds_after_coming_back_starts_its_back_off_again(tmp_path, monkeypatch):
    from tests.helpers.disk_helpers import chunk, key, make_tier

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    tier = make_tier([tmp_path], retry=30.0)
    path = tier.paths[0]

    def fail(i):
        with failing_io(monkeypatch, "slots-", err=errno.EROFS, calls=("pwritev",)):
            assert not tier.write(i, key(i), chunk(i).array).ok
        assert tier.down_paths

    fail(0)
    assert path.retry_at == clock[0] + 30
    clock[0] += 30
    assert tier.revive(0) and path.retry_every == 60
    clock[0] += 59
    fail(1)  # failed again within its wait: the back-off goes on growing
    assert path.retry_at == clock[0] + 60
    clock[0] += 60
    assert tier.revive(0) and path.retry_every == 120
    clock[0] += 120
    fail(2)  # held for its whole wait: a new fault starts from disk_retry
    assert path.retry_every == 30 and path.retry_at == clock[0] + 30
    tier.close()


def test_a_read_job_the_engine_fails_before_it_runs_gives_its_host_slot_back(tmp_path):
    """An I/O engine whose job raises before the read runs: each chunk of it is a failed
    read at once (not a wait for ``load_timeout``), and the host slot reserved for it comes
    back, so puts still find room."""
    kept = [seq(0, 1), seq(1000, 1)]
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as store:
        for tokens in kept:
            store.put(tokens, make_kv(tokens))
        assert store.flush()
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, config(tmp_path, host_chunks=2, load_timeout=5.0), io_engine=make) as store:
        engines[0].fail(OSError(errno.EIO, "the engine failed"))
        for tokens in kept:
            assert exact(store, tokens) == 0
        assert store.stats().load_timeouts == 0  # failed reads, not reads waited for in vain
        engines[0]._errors.clear()  # white-box: the engine works again
        with bookkeeping(store) as stack:
            assert all(index.census().writing == 0 and index.census().pins == 0
                       for index in stack.indexes.values())
        fresh = seq(5000, 2)
        assert store.put(fresh, make_kv(fresh)) == 2 * CHUNK


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_flush_on_a_hung_drive_counts_the_writes_not_over_as_not_written(tmp_path, policy):
    """A chunk whose write is queued or hung is not on disk when the flush returns: it was
    counted neither written nor not written. Found by a review."""
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, config(tmp_path, write_policy=policy), io_engine=make) as store:
        engines[0].hold()  # the drive stops answering
        tokens = seq(0, 3)
        store.put(tokens, make_kv(tokens))
        result = store.flush(timeout=0.3)
        assert not result and result.timed_out
        assert (result.written, result.not_written) == (0, 3)
        engines[0].release()
        assert store.flush(timeout=10) and store.lookup(tokens).tokens == len(tokens)


def test_a_flush_of_device_pool_chunks_on_a_hung_drive_ends_at_its_timeout(tmp_path):
    """Chunks held only in the device pool are written one at a time; on a hung drive the
    first write was waited for ``load_timeout``, and with ``load_timeout`` off for ever,
    whatever the flush's own timeout. Found by a review."""
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, config(tmp_path, host_chunks=2, gpu_capacity=2 * CHUNK_BYTES,
                               load_timeout="off"), io_engine=make) as store:
        tokens = seq(0, 2)
        store.put(tokens, make_kv(tokens))  # both in the device pool only
        engines[0].hold()
        results = []
        flushing = threading.Thread(target=lambda: results.append(store.flush(timeout=0.3)))
        flushing.start()
        flushing.join(10)
        returned = bool(results)  # before the drive answers again
        engines[0].release()
        flushing.join(10)
        assert returned, "the flush did not return while the drive hung"
        assert results[0].timed_out and results[0].not_written == 2
        assert store.flush(timeout=10)
