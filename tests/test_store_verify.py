"""``KVStore.verify_against``: cached chunks checked against KV computed now. An intact chunk
under the wrong key (another prompt's bytes, a valid header and checksum: what no checksum
catches) is found in each tier it can be served from (host memory, disk, another writer's
segment, the remote store), removed from every tier, counted by tier; a cache that is right
raises no alarm."""

import errno
import threading

import numpy as np
import pytest
import torch

from kvtier import KVStore
from kvtier.io.buffers import AlignedBuffer
from kvtier.store.tolerance import same_kv
from kvtier.tiers.base import TierName
from tests.helpers.disk_helpers import wait_until
from tests.helpers.fake_io import FakeEngine
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, make_kv, same_bytes
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.shared import shared, wait_for
from tests.helpers.store import config, exact, load, remote_store, seq

HOST, DISK, SHARED, REMOTE = TierName.HOST, TierName.DISK, TierName.SHARED, TierName.REMOTE
A, B = seq(0, 4), seq(50_000, 4)


def raw(store: KVStore, tokens, chunk: int) -> np.ndarray:
    """Chunk ``chunk`` of ``tokens`` as its slot holds it (from host memory)."""
    slot = store._books.slot_of(HOST, store.keys(tokens)[chunk])
    assert slot is not None, "the chunk is not in host memory"
    return store.tiers[HOST].slot_array(slot)[:CHUNK_BYTES].copy()


def swap_on_disk(store: KVStore, chunk: int) -> None:
    """A's chunk ``chunk`` on disk replaced by B's first chunk: A's key, a valid checksum."""
    key = store.keys(A)[chunk]
    slot = store._books.slot_of(DISK, key)
    assert slot is not None and store.disk is not None
    buffer = AlignedBuffer(CHUNK_BYTES)  # direct I/O: an aligned buffer
    buffer.array[:] = raw(store, B, 0)
    assert store.disk.write(slot, key, buffer.array).ok


def test_a_right_cache_raises_no_alarm(tmp_path):
    with KVStore(SMALL, config(tmp_path, host_chunks=16)) as store:
        for start in range(0, 400_000, 40_000):
            tokens = seq(start, 3)
            store.put(tokens, make_kv(tokens))
            found = store.verify_against(tokens, make_kv(tokens))
            assert found.ok and found.checked == 3 and found.mismatched == {}
        assert store.stats().chunks_verified == 30 and not store.stats().verify_mismatches


def test_tokens_with_nothing_cached_check_nothing():
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 16 * CHUNK_BYTES, "model": "m"}
    with KVStore(SMALL, cfg) as store:
        found = store.verify_against(A, make_kv(A))
        assert found.ok and found.checked == 0 and store.stats().chunks_verified == 0


def test_another_prompts_chunk_in_host_memory_is_caught_and_removed():
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 16 * CHUNK_BYTES, "model": "m"}
    with KVStore(SMALL, cfg) as store:
        store.put(A, make_kv(A))
        store.put(B, make_kv(B))
        slot = store._books.slot_of(HOST, store.keys(A)[1])
        store.tiers[HOST].slot_array(slot)[:CHUNK_BYTES] = raw(store, B, 0)  # a page copy gone wrong
        n, served = load(store, A)
        assert n == 4 * CHUNK and not same_bytes(served, make_kv(A))  # no checksum catches it
        found = store.verify_against(A, make_kv(A))
        assert found.checked == 4 and found.mismatched == {HOST: 1}
        assert found.removed == (store.keys(A)[1],)
        assert store.lookup(A).tokens == CHUNK and exact(store, A) == CHUNK
        assert store.stats().verify_mismatches == {HOST: 1}
        samples = {s.name: s for s in store.metric_samples()}
        assert samples["verify_mismatches_total"].values[(("tier", "host"),)] == 1


def test_another_prompts_chunk_on_disk_is_caught_removed_and_not_found_after_a_restart(tmp_path):
    with KVStore(SMALL, config(tmp_path, host_chunks=8)) as store:
        store.put(A, make_kv(A))
        store.put(B, make_kv(B))
        assert store.flush()
        swap_on_disk(store, 2)
    with KVStore(SMALL, config(tmp_path, host_chunks=8)) as store:  # A's chunks from disk now
        assert store.lookup(A).chunks_by_tier == {DISK: 4}
        found = store.verify_against(A, make_kv(A))
        assert found.mismatched == {DISK: 1} and found.removed == (store.keys(A)[2],)
        assert exact(store, A) == 2 * CHUNK
    with KVStore(SMALL, config(tmp_path, host_chunks=8)) as store:
        assert store.lookup(A).tokens == 2 * CHUNK  # its slot was blanked: gone for good


def test_another_prompts_chunk_in_another_writers_segment_is_caught_and_not_read_again(tmp_path):
    with KVStore(SMALL, shared(tmp_path, "a", host_chunks=8)) as a:
        a.put(A, make_kv(A))
        a.put(B, make_kv(B))
        assert a.flush()
        swap_on_disk(a, 3)
        with KVStore(SMALL, shared(tmp_path, "b", share_refresh="1h")) as b:
            wait_for(lambda: b.lookup(A).tokens == 4 * CHUNK)
            assert b.lookup(A).chunks_by_tier == {SHARED: 4}
            found = b.verify_against(A, make_kv(A))
            assert found.mismatched == {SHARED: 1} and found.removed == (b.keys(A)[3],)
            assert b.lookup(A).tokens == 3 * CHUNK and exact(b, A) == 3 * CHUNK


@needs_redis
def test_another_prompts_value_in_the_remote_store_is_caught_and_removed_there(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        with remote_store(server.url) as a:
            a.put(A, make_kv(A))
            a.put(B, make_kv(B))
            assert a.flush()
            tier = a._state.remote.tier
            key = a.keys(A)[1]
            assert tier.put_many([(key, raw(a, B, 0))])[0].ok  # a writer that mislabels
        with remote_store(server.url) as c:
            assert c.lookup(A).chunks_by_tier == {REMOTE: 4}
            found = c.verify_against(A, make_kv(A))
            assert found.mismatched == {REMOTE: 1} and found.removed == (key,)
            assert c._state.remote.tier.exists([key]) == [False]  # gone for every node
        with remote_store(server.url) as d:
            assert d.lookup(A).tokens == CHUNK
    finally:
        server.stop()


def test_a_tolerance_passes_kv_that_differs_only_within_it():
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 16 * CHUNK_BYTES, "model": "m"}
    with KVStore(SMALL, cfg) as store:
        kv = make_kv(A)
        kv[0, 0, 5, 3] = 1.0
        store.put(A, kv)
        nudged = kv.clone()
        nudged[0, 0, 5, 3] = 1.0078125  # the next bfloat16 after 1.0
        assert not store.verify_against(A, nudged).ok  # byte for byte: caught
        store.put(A, kv)
        assert store.verify_against(A, nudged, atol=0.01).ok


def test_a_relative_tolerance_passes_a_nudge_and_catches_another_prompts_kv():
    """The engine's comparison (``tolerance``: a share of each fresh chunk's largest value):
    a value one bfloat16 step off passes at 4e-2; another prompt's KV does not."""
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 16 * CHUNK_BYTES, "model": "m"}
    with KVStore(SMALL, cfg) as store:
        kv = make_kv(A)
        store.put(A, kv)
        nudged = kv.clone()
        nudged[0, 0, 5, 3] = nudged[0, 0, 5, 3] * 1.0078125
        assert store.verify_against(A, nudged, tolerance=4e-2).ok
        found = store.verify_against(A, make_kv(B), tolerance=4e-2)
        assert found.checked == 4 and len(found.removed) == 4


def test_kv_of_the_wrong_shape_is_refused_naming_it():
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 16 * CHUNK_BYTES, "model": "m"}
    with KVStore(SMALL, cfg) as store, pytest.raises(ValueError, match="kv"):
        store.verify_against(A, torch.zeros(3, 2, 4 * CHUNK, 32, dtype=torch.bfloat16))


def test_a_dtype_named_as_torch_prints_it_is_compared_the_same():
    fresh = torch.randn(256)
    moved = fresh + 1e-7
    for name in ("float32", "torch.float32"):
        assert same_kv(moved.view(torch.uint8), fresh.view(torch.uint8), name, 1e-3), name
        assert not same_kv(torch.randn(256).view(torch.uint8), fresh.view(torch.uint8), name, 1e-3)


def test_a_chunk_found_wrong_while_its_disk_write_runs_is_not_committed_by_it(tmp_path):
    """The write-through, once over, committed the chunk that verification had removed
    meanwhile: it was served again, and after a restart. Found by a review."""
    make, engines = FakeEngine.factory()
    wrong = make_kv(B)  # another prompt's KV under A's keys
    with KVStore(SMALL, config(tmp_path), io_engine=make) as store:
        engines[0].hold(*engines[0].queues)  # a slow disk: the writes wait
        store.put(A, wrong)
        assert store.verify_against(A, make_kv(A)).removed == tuple(store.keys(A))
        engines[0].release(*engines[0].queues)
        store.flush()
        assert store.lookup(A).tokens == 0 and load(store, A)[0] == 0
    with KVStore(SMALL, config(tmp_path)) as store:
        assert store.lookup(A).tokens == 0


@needs_redis
def test_a_chunk_found_wrong_while_its_remote_write_runs_is_removed_once_it_is_over(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        with remote_store(server.url) as a:
            tier, release = a._state.remote.tier, threading.Event()
            real = tier.put_many
            tier.put_many = lambda items: (release.wait(10), real(items))[1]
            a.put(A, make_kv(B))
            assert a.verify_against(A, make_kv(A)).removed == tuple(a.keys(A))
            release.set()
            assert a._state.remote.drain(10)
            assert tier.exists(list(a.keys(A))) == [False] * 4
    finally:
        server.stop()


def _two_copies_on_disk(store: KVStore, engine, kv) -> None:
    """A's first chunk written twice, in two slots, as ``kv``: the first copy's slot given
    back unwritten by a read that failed (its header and index entry stay)."""
    one, other = A[:CHUNK], seq(1000, 1)
    store.put(one, kv)
    store.put(other, make_kv(other))
    assert store.flush()  # written: neither is held in host memory by its write
    for n in range(4):  # out of host memory: both on disk only
        store.put(seq(2000 + 100 * n, 1), make_kv(seq(2000 + 100 * n, 1)))
    assert store.flush()
    gone = (*store.keys(one), *store.keys(other))
    assert all(store._books.slot_of(HOST, key) is None for key in gone)
    engine.fail(OSError(errno.EIO, "injected"), *engine.queues)
    assert load(store, one)[0] == 0 and load(store, other)[0] == 0  # dropped, not blanked
    engine.heal()
    store.put(one, kv)  # again, in another slot
    assert store.flush()


def test_a_chunk_found_wrong_has_every_copy_on_disk_removed(tmp_path):
    """Verification blanked the copy the bookkeeping knew; a start-up then took the older
    copy, as wrong, and served it. Found by a review."""
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, config(tmp_path), io_engine=make) as store:
        _two_copies_on_disk(store, engines[0], make_kv(B)[:, :, :CHUNK])
        assert store.verify_against(A[:CHUNK], make_kv(A[:CHUNK])).removed
    with KVStore(SMALL, config(tmp_path)) as store:
        assert store.lookup(A[:CHUNK]).tokens == 0


def test_a_reader_of_the_directory_serves_no_older_copy_of_a_chunk_found_wrong(tmp_path):
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, shared(tmp_path, "w"), io_engine=make) as writer, \
            KVStore(SMALL, shared(tmp_path, "r")) as reader:
        _two_copies_on_disk(writer, engines[0], make_kv(B)[:, :, :CHUNK])
        wait_for(lambda: reader.lookup(A[:CHUNK]).tokens == CHUNK)
        assert writer.verify_against(A[:CHUNK], make_kv(A[:CHUNK])).removed
        wait_for(lambda: reader.lookup(A[:CHUNK]).tokens == 0)


def _writes_over(store: KVStore) -> None:
    wait_until(lambda: store._runner.disk_writes.writes_pending == 0, "the disk writes")


def test_a_chunk_found_wrong_at_rest_on_disk_leaves_its_next_write_alone(tmp_path):
    """Every chunk found wrong on disk was marked as being written (a committed entry counted
    too), and the right KV put again after was blanked once written. Found by a review."""
    with KVStore(SMALL, config(tmp_path, host_chunks=8)) as store:
        store.put(A, make_kv(B))
        assert store.flush()
        assert store.verify_against(A, make_kv(A)).removed == tuple(store.keys(A))
        assert store._state.forgotten == set()
        store.put(A, make_kv(A))  # computed again, right
        _writes_over(store)
        assert all(store._books.slot_of(DISK, key) is not None for key in store.keys(A))


def test_a_write_that_ends_while_a_chunk_is_removed_leaves_no_copy(tmp_path, monkeypatch):
    """The write-through of a chunk found wrong ends while ``forget`` runs: whichever comes
    first, no start-up finds the chunk. Found by a review."""
    import kvtier.store.verify as verify

    make, engines = FakeEngine.factory()
    real = verify.blank_every_copy

    def blank_then_the_write_ends(lane, key):
        real(lane, key)
        engines[0].release(*engines[0].queues)
        _writes_over(store)

    with KVStore(SMALL, config(tmp_path), io_engine=make) as store:
        engines[0].hold(*engines[0].queues)
        store.put(A, make_kv(B))
        monkeypatch.setattr(verify, "blank_every_copy", blank_then_the_write_ends)
        assert store.verify_against(A, make_kv(A)).removed == tuple(store.keys(A))
        monkeypatch.undo()
    with KVStore(SMALL, config(tmp_path)) as store:
        assert store.lookup(A).tokens == 0


def test_an_index_that_cannot_be_read_does_not_stop_a_removal(tmp_path, monkeypatch):
    from kvtier.segment.cachedir import CacheDir

    with KVStore(SMALL, config(tmp_path, host_chunks=8)) as store:
        store.put(A, make_kv(B))
        assert store.flush()
        monkeypatch.setattr(CacheDir, "read_index", lambda self: (_ for _ in ()).throw(
            OSError(errno.EIO, "injected")))
        assert store.verify_against(A, make_kv(A)).removed == tuple(store.keys(A))
        assert store.lookup(A).tokens == 0


def test_a_device_pool_chunk_found_wrong_while_flush_writes_it_is_not_committed(tmp_path):
    """Flush writes a device pool chunk to disk from a copy of its own; found wrong while
    that write ran (past ``load_timeout``, left running), it was committed once over, and a
    start-up served it. Found by a review."""
    make, engines = FakeEngine.factory()
    cfg = config(tmp_path, gpu_capacity=4 * CHUNK_BYTES, load_timeout="100ms")
    two = A[:2 * CHUNK]  # two writes given up on: the path stays in service (three, not)
    with KVStore(SMALL, cfg, io_engine=make) as store:
        store.put(two, make_kv(B)[:, :, :2 * CHUNK])  # in the device pool only
        engines[0].hold(*engines[0].queues)
        store.flush(timeout=1)  # its writes left running
        assert store.verify_against(two, make_kv(two)).removed == tuple(store.keys(two))
        engines[0].release(*engines[0].queues)
        wait_until(lambda: store.stats().disk_writes == 2, "the writes over")
        assert not store.stats().paths_down
        marked = set(store._state.forgotten)
    with KVStore(SMALL, config(tmp_path)) as store:
        assert store.lookup(two).tokens == 0
    assert not marked


def test_every_copy_of_several_chunks_is_found_in_one_read_of_each_index(tmp_path):
    from kvtier.disk.copies import slots_naming

    paths = [tmp_path / "a", tmp_path / "b"]
    for path in paths:
        path.mkdir(mode=0o700)
    with KVStore(SMALL, config(tmp_path, disk_chunks=16,
                               disk_paths=[str(path) for path in paths])) as store:
        one, two = seq(0, 1), seq(1000, 1)
        for tokens in (one, two, seq(2000, 1)):
            store.put(tokens, make_kv(tokens))
        assert store.flush()
        keys = [store.keys(one)[0], store.keys(two)[0]]
        buffer = AlignedBuffer(CHUNK_BYTES)
        for spare, key in zip((14, 15), keys, strict=True):  # second copies, on both paths
            assert store.disk.write(spare, key, buffer.array).ok
        found = slots_naming(store.disk, keys)
        assert sorted(key for _, key in found) == sorted(keys * 2)
        assert {14, 15} <= {slot for slot, _ in found}


def test_a_wrong_chunk_another_get_is_reading_when_it_is_removed_is_not_cached_again(
        tmp_path, monkeypatch):
    """Between verify_against's own get and its removal, another caller's get starts reading
    the chunk from disk into host memory; its read has the bytes before the header is
    blanked, and ends after the removal. That read is not committed: the wrong chunk was
    back in host memory, served to every later get. Found by a review."""
    from kvtier.store import kvstore as kvstore_module
    from kvtier.store.read_jobs import ReadJobs

    a, b = seq(0, 1), seq(90_000, 1)
    with KVStore(SMALL, config(tmp_path, host_chunks=4)) as before:
        before.put(a, make_kv(b))  # another prompt's KV under a's key
        assert before.flush()
    landed, removed, slow = threading.Event(), threading.Event(), threading.Event()
    real_read, real_forget = ReadJobs._read_and_blank, kvstore_module.forget

    def read_then_wait(self, items):
        results = real_read(self, items)
        if slow.is_set():  # the bytes are in the host slot; the read ends after the removal
            landed.set()
            removed.wait(10)
        return results

    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as store:
        def forget(state, keys):
            for t in (seq(100_000, 1), seq(110_000, 1)):  # another caller's puts: a's chunk
                store.put(t, make_kv(t))  # leaves host memory, its disk copy stays
            slow.set()
            other = threading.Thread(target=load, args=(store, a))
            other.start()
            assert landed.wait(10)
            slow.clear()
            real_forget(state, keys)
            removed.set()
            other.join(10)

        monkeypatch.setattr(ReadJobs, "_read_and_blank", read_then_wait)
        monkeypatch.setattr(kvstore_module, "forget", forget)
        assert store.verify_against(a, make_kv(a)).removed == tuple(store.keys(a))
        assert store.lookup(a).tokens == 0
        assert load(store, a)[0] == 0


def test_a_copy_into_another_tier_does_not_take_the_mark_of_the_read_found_wrong(
        tmp_path, monkeypatch):
    """The chunk is removed while another get's read of it into host memory is in flight;
    a put of its right KV into the device pool ends first. The mark that aborts the read
    belongs to the host tier's copy: the put took it, the read committed the wrong bytes,
    and later gets were served them. Found by a review."""
    from kvtier.store.read_jobs import ReadJobs
    from kvtier.store.verify import forget

    a, b = seq(0, 1), seq(90_000, 1)
    with KVStore(SMALL, config(tmp_path, host_chunks=4)) as before:
        before.put(a, make_kv(b))  # another prompt's KV under a's key
        assert before.flush()
    landed, removed, slow = threading.Event(), threading.Event(), threading.Event()
    real_read = ReadJobs._read_and_blank

    def read_then_wait(self, items):
        results = real_read(self, items)
        if slow.is_set():
            landed.set()
            removed.wait(10)
        return results

    monkeypatch.setattr(ReadJobs, "_read_and_blank", read_then_wait)
    with KVStore(SMALL, config(tmp_path, host_chunks=2, gpu_capacity=CHUNK_BYTES)) as store:
        slow.set()
        other = threading.Thread(target=load, args=(store, a))
        other.start()
        assert landed.wait(10)
        slow.clear()
        forget(store._state, store.keys(a))  # what verify_against does on a mismatch
        store.put(a, make_kv(a))  # right KV, into the device pool
        removed.set()
        other.join(10)
        n, out = load(store, a)
        assert n == len(a) and same_bytes(out, make_kv(a))
