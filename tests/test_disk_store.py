"""KVStore with a disk tier: write policies, restart, streaming loads, bounds, isolation."""

import os
import threading

import pytest

from kvtier import KVLayout, KVStore
from kvtier.store.state import StoreState
from kvtier.tiers.base import TierName
from tests.helpers.disk_helpers import wait_until
from tests.helpers.fake_io import FakeEngine
from tests.helpers.kv import CHUNK, SMALL, bookkeeping, make_kv
from tests.helpers.store import STRIDE, config, exact, load, seq

HOST, DISK = TierName.HOST, TierName.DISK


def test_restart_serves_chunks_from_disk(tmp_path):
    tokens = seq(0, 6)
    with KVStore(SMALL, config(tmp_path)) as store:
        store.put(tokens, make_kv(tokens))
        store.flush()
    with KVStore(SMALL, config(tmp_path)) as store:
        assert store.stats().recovered_chunks == 6
        assert store.lookup(tokens).chunks_by_tier == {DISK: 6}
        assert exact(store, tokens) == 6 * CHUNK
        assert store.stats().chunks_loaded == {DISK: 6}
        assert store.lookup(tokens[:4 * CHUNK]).chunks_by_tier[HOST] >= 1  # promoted


def test_a_get_reads_neighbouring_small_chunks_in_one_job(tmp_path):
    """Small chunks of one prefix on disk go to the I/O threads together (a job, and a
    vectored call per run of neighbouring slots, for each refill of the read window: here
    its 4 places, then the 2 chunks left once it is empty: a read group of these small
    chunks is larger than the window), not one hand-off per chunk."""
    tokens = seq(0, 6)
    with KVStore(SMALL, config(tmp_path, host_chunks=16)) as store:
        store.put(tokens, make_kv(tokens))
        store.flush()
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, config(tmp_path, host_chunks=16), io_engine=make) as store:
        before = sum(engines[0].submitted.values())
        assert exact(store, tokens) == 6 * CHUNK
        assert sum(engines[0].submitted.values()) - before == 2
        assert store.stats().chunks_loaded == {DISK: 6}


def test_write_through_writes_every_chunk_in_the_background(tmp_path):
    with KVStore(SMALL, config(tmp_path, host_chunks=16)) as store:
        store.put(seq(0, 5), make_kv(seq(0, 5)))
        store.flush()
        stats = store.stats()
        assert stats.disk_writes == 5 and stats.disk_write_bytes == 5 * STRIDE
        assert store.lookup(seq(0, 5)).chunks_by_tier == {HOST: 5}


def test_write_back_writes_only_what_host_evicts_until_a_flush(tmp_path):
    with KVStore(SMALL, config(tmp_path, host_chunks=4, write_policy="write_back")) as store:
        store.put(seq(0, 3), make_kv(seq(0, 3)))
        assert store.stats().disk_writes == 0
        store.put(seq(1000, 3), make_kv(seq(1000, 3)))  # evictions are written within put
        assert store.stats().disk_writes == 2  # two of the first three made room
        flushed = store.flush()  # finding 16: every host chunk reaches disk
        assert flushed and flushed.written == 4 and store.stats().disk_writes == 6
        assert exact(store, seq(0, 3)) == 3 * CHUNK


def test_a_load_larger_than_host_memory_streams_through_it(tmp_path):
    tokens = seq(0, 12)
    with KVStore(SMALL, config(tmp_path, host_chunks=4)) as store:
        store.put(tokens, make_kv(tokens))
        store.flush()
        assert store.lookup(tokens).tokens == 12 * CHUNK
        assert exact(store, tokens) == 12 * CHUNK


def test_disk_capacity_is_a_hard_bound(tmp_path):
    with KVStore(SMALL, config(tmp_path, host_chunks=2, disk_chunks=8)) as store:
        for i in range(30):
            store.put(seq(i * 1000, 1), make_kv(seq(i * 1000, 1)))
        store.flush()
        assert store.stats().evictions["disk"] > 0
        files = list(tmp_path.glob("*/writers/*/slots-*.kvt"))
        assert sum(f.stat().st_size for f in files) <= 8 * STRIDE
        cached = sum(store.lookup(seq(i * 1000, 1)).tokens > 0 for i in range(30))
        assert cached <= 8 + 2
        for i in range(30):
            exact(store, seq(i * 1000, 1))


def test_shrinking_the_disk_keeps_within_the_new_bound(tmp_path):
    with KVStore(SMALL, config(tmp_path, host_chunks=2, disk_chunks=16)) as store:
        store.put(seq(0, 16), make_kv(seq(0, 16)))
        store.flush()
    with KVStore(SMALL, config(tmp_path, host_chunks=2, disk_chunks=4)) as store:
        assert store.stats().recovered_chunks <= 4
        assert sum(f.stat().st_size for f in tmp_path.glob("*/writers/*/slots-*.kvt")) <= 4 * STRIDE
        exact(store, seq(0, 16))


def _slot_writes_wait(monkeypatch, only: str = "") -> threading.Event:
    """Writes into slot files (under ``only``, where given) wait (at most 60 s) until the
    event returned is set."""
    release = threading.Event()
    real = os.pwritev

    def stuck(fd, buffers, offset):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if "slots-" in name and name.startswith(only):
            release.wait(timeout=60)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", stuck)
    return release


def test_full_write_queue_drops_writes_instead_of_blocking(tmp_path, monkeypatch):
    release = _slot_writes_wait(monkeypatch)
    store = KVStore(SMALL, config(tmp_path, host_chunks=32, io_threads=1))
    done = threading.Event()
    worker = threading.Thread(target=lambda: (store.put(seq(0, 24), make_kv(seq(0, 24))), done.set()))
    worker.start()
    worker.join(timeout=30)
    assert done.is_set(), "put waited for the disk"
    assert store.stats().dropped_writes == 24 - 16  # the queue: half the 32 host slots
    release.set()
    flushed = store.flush()  # finding 16: flush writes the dropped chunks too
    assert flushed and flushed.written == 8 and store.stats().disk_writes == 24
    assert exact(store, seq(0, 24)) == 24 * CHUNK
    store.close()


def test_namespaces_sharing_a_directory_never_see_each_other(tmp_path):
    fp16 = KVLayout(num_layers=2, kv_heads=2, head_size=16, dtype="float16")
    tokens = seq(0, 2)
    with KVStore(SMALL, config(tmp_path)) as a, KVStore(fp16, config(tmp_path)) as b:
        a.put(tokens, make_kv(tokens))
        a.flush()
        assert b.lookup(tokens).tokens == 0
    with KVStore(fp16, config(tmp_path)) as b:
        assert b.stats().recovered_chunks == 0 and b.lookup(tokens).tokens == 0
    with KVStore(SMALL, config(tmp_path), model="other-model") as c:
        assert c.lookup(tokens).tokens == 0
    assert len(list(tmp_path.iterdir())) == 3  # one directory per namespace


def test_two_stores_on_one_namespace_write_their_own_segments(tmp_path):
    tokens = seq(0, 2)
    two = config(tmp_path, share_writers=2)
    with KVStore(SMALL, two) as first, KVStore(SMALL, two) as second:
        assert not first.stats().paths_down and not second.stats().paths_down
        for store in (first, second):
            store.put(tokens, make_kv(tokens))
            store.flush()
            assert store.stats().disk_writes == 2 and exact(store, tokens) == 2 * CHUNK
    assert len(list(tmp_path.glob("*/writers/*/slots-0000.kvt"))) == 2


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_compression_round_trips_through_the_store(tmp_path, compression):
    tokens = seq(0, 6)
    with KVStore(SMALL, config(tmp_path, compression=compression)) as store:
        store.put(tokens, make_kv(tokens))
        store.flush()
    with KVStore(SMALL, config(tmp_path)) as store:  # reading needs no compression setting
        assert exact(store, tokens) == 6 * CHUNK


def test_a_get_that_fails_midway_leaves_no_pin(tmp_path, monkeypatch):
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as store:
        tokens = seq(0, 4)
        store.put(tokens, make_kv(tokens))
        store.flush()

        def device_lost(self):
            raise RuntimeError("device lost")

        monkeypatch.setattr(StoreState, "sync", device_lost)
        with pytest.raises(RuntimeError, match="device lost"):
            load(store, tokens)
        monkeypatch.undo()
        with bookkeeping(store) as stack:
            assert all(index.census().pins == 0 for index in stack.indexes.values())
        assert exact(store, tokens) == 4 * CHUNK


def test_a_write_dropped_from_a_full_queue_evicts_nothing_from_disk(tmp_path, monkeypatch):
    """The disk full of chunks, its write queue full: a write-through that is dropped took
    a disk slot first, evicting a chunk there for nothing. Found by a review."""
    singles = [seq(1000 * (i + 1), 1) for i in range(8)]
    with KVStore(SMALL, config(tmp_path, host_chunks=8, disk_chunks=8)) as store:
        for tokens in singles:
            store.put(tokens, make_kv(tokens))
        assert store.flush()
    release = _slot_writes_wait(monkeypatch)
    store = KVStore(SMALL, config(tmp_path, host_chunks=8, disk_chunks=8, io_threads=1))
    try:
        store.put(seq(0, 8), make_kv(seq(0, 8)))  # 4 writes queue (half the host slots)
        assert store.stats().dropped_writes == 4
        # the 4 queued took 4 disk slots from the singles; the 4 dropped took none
        assert sum(store.lookup(tokens).tokens > 0 for tokens in singles) == 4
    finally:
        release.set()
        store.close()


def test_a_write_dropped_from_one_full_path_evicts_nothing_from_disk(tmp_path, monkeypatch):
    """Two paths, the disk full of chunks, one path's writes stuck, the other's done before
    the next put: a write-through whose disk slot's victim lay on the stuck path (its queue
    full) was dropped after that victim was evicted, since the other path's queue had room.
    Found by a review."""
    paths = [tmp_path / "a", tmp_path / "b"]
    for path in paths:
        path.mkdir(mode=0o700)
    cfg = config(tmp_path, host_chunks=16, disk_chunks=16, disk_paths=[str(p) for p in paths])
    singles = [seq(1000 * (i + 1), 1) for i in range(16)]
    with KVStore(SMALL, cfg) as store:
        for tokens in singles:
            store.put(tokens, make_kv(tokens))
        assert store.flush()
    release = _slot_writes_wait(monkeypatch, only=str(paths[0]))
    store = KVStore(SMALL, {**cfg, "io_threads": 1})
    try:
        # 4 queue on the stuck path at most; as many puts as singles, so that 8 victims lie
        # on the stuck path whatever order the restart's recovery left them in
        puts = len(singles)
        for n in range(puts):
            store.put(seq(100_000 * (n + 1), 1), make_kv(seq(100_000 * (n + 1), 1)))
            other = store._runner.disk_writes.groups["disk1"]
            wait_until(lambda: other.pending == 0, "the other path's write")  # noqa: B023
        dropped = store.stats().dropped_writes
        assert dropped > 0
        # each write queued took a disk slot from a single; each dropped took none
        kept = sum(store.lookup(tokens).tokens > 0 for tokens in singles)
        assert kept == len(singles) - (puts - dropped)
    finally:
        release.set()
        store.close()
