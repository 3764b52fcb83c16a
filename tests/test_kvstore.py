"""KVStore: the standalone tiered store, end to end through real tiers."""

import threading

import numpy as np
import pytest
import torch

from kvtier import KVStore
from kvtier.errors import ConfigError, LayoutError
from kvtier.tiers.base import TierName
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, bookkeeping, make_kv, same_bytes

GPU, HOST = TierName.GPU, TierName.HOST


def make_store(host_chunks=8, gpu_chunks=0, **extra) -> KVStore:
    config = {"chunk_tokens": CHUNK, "host_capacity": host_chunks * CHUNK_BYTES,
              "gpu_capacity": gpu_chunks * CHUNK_BYTES, **extra}
    return KVStore(SMALL, config, model="test-model")


def seq(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def read(store: KVStore, tokens) -> tuple[int, torch.Tensor]:
    out = torch.zeros(SMALL.shape(len(tokens)), dtype=torch.bfloat16)
    return store.get(tokens, out), out


def test_round_trip_gives_the_same_bytes():
    with make_store() as store:
        tokens = seq(0, 4 * CHUNK)
        assert store.put(tokens, make_kv(tokens)) == 4 * CHUNK
        n, out = read(store, tokens)
        assert n == 4 * CHUNK and same_bytes(out, make_kv(tokens))


def test_empty_and_short_sequences_store_nothing():
    with make_store() as store:
        assert store.put([], make_kv([])) == 0
        assert store.put(seq(0, CHUNK - 1), make_kv(seq(0, CHUNK - 1))) == 0
        assert store.lookup([]).tokens == 0
        assert read(store, seq(0, CHUNK - 1))[0] == 0


def test_partial_trailing_chunk_is_not_stored():
    with make_store() as store:
        tokens = seq(0, 2 * CHUNK + 5)
        assert store.put(tokens, make_kv(tokens)) == 2 * CHUNK
        assert store.lookup(tokens).tokens == 2 * CHUNK


def test_lookup_finds_the_longest_shared_prefix():
    with make_store() as store:
        tokens = seq(0, 3 * CHUNK)
        store.put(tokens, make_kv(tokens))
        diverging = [*tokens[:CHUNK + 3], 99999, *tokens[CHUNK + 4:]]
        assert store.lookup(diverging).tokens == CHUNK
        assert store.lookup(tokens + seq(500, 2 * CHUNK)).tokens == 3 * CHUNK
        n, out = read(store, diverging)
        assert n == CHUNK and same_bytes(out[:, :, :CHUNK], make_kv(tokens)[:, :, :CHUNK])


def test_get_loads_no_more_than_out_holds():
    with make_store() as store:
        tokens = seq(0, 3 * CHUNK)
        store.put(tokens, make_kv(tokens))
        out = torch.zeros(SMALL.shape(CHUNK + 4), dtype=torch.bfloat16)
        assert store.get(tokens, out) == CHUNK
        assert same_bytes(out[:, :, :CHUNK], make_kv(tokens)[:, :, :CHUNK])
        assert not out[:, :, CHUNK:].view(torch.int16).any()


def test_storing_again_only_refreshes():
    with make_store() as store:
        tokens = seq(0, 2 * CHUNK)
        store.put(tokens, make_kv(tokens))
        assert store.put(tokens, make_kv(tokens)) == 0
        assert store.stats().chunks_skipped == 2


def test_lru_evicts_the_least_recently_used_chunk():
    with make_store(host_chunks=2) as store:
        a, b, c = seq(0, CHUNK), seq(1000, CHUNK), seq(2000, CHUNK)
        store.put(a, make_kv(a))
        store.put(b, make_kv(b))
        read(store, a)  # a is now more recent than b
        store.put(c, make_kv(c))
        assert [store.lookup(t).tokens for t in (a, b, c)] == [CHUNK, 0, CHUNK]
        assert store.stats().evictions == {"host": 1}


def test_fifo_evicts_the_oldest_chunk():
    with make_store(host_chunks=2, eviction_policy="fifo") as store:
        a, b, c = seq(0, CHUNK), seq(1000, CHUNK), seq(2000, CHUNK)
        store.put(a, make_kv(a))
        store.put(b, make_kv(b))
        read(store, a)
        store.put(c, make_kv(c))
        assert [store.lookup(t).tokens for t in (a, b, c)] == [0, CHUNK, CHUNK]


def test_device_pool_sits_above_host_and_demotes_into_it():
    with make_store(host_chunks=4, gpu_chunks=2) as store:
        assert list(store.tiers) == [GPU, HOST]
        tokens = seq(0, 4 * CHUNK)
        store.put(tokens, make_kv(tokens))  # 4 chunks, 2 gpu slots: 2 demoted to host
        hit = store.lookup(tokens)
        assert hit.tokens == 4 * CHUNK and hit.chunks_by_tier == {GPU: 2, HOST: 2}
        assert store.stats().demotions == 2
        n, out = read(store, tokens)
        assert n == 4 * CHUNK and same_bytes(out, make_kv(tokens))


def test_reading_from_host_promotes_to_the_device_pool():
    with make_store(host_chunks=4, gpu_chunks=1) as store:
        a, b = seq(0, CHUNK), seq(1000, CHUNK)
        store.put(a, make_kv(a))
        store.put(b, make_kv(b))  # a demoted to host
        assert store.lookup(a).chunks_by_tier == {HOST: 1}
        n, out = read(store, a)
        assert n == CHUNK and same_bytes(out, make_kv(a))
        assert store.lookup(a).chunks_by_tier == {GPU: 1}
        assert store.lookup(b).chunks_by_tier == {HOST: 1}
        stats = store.stats()
        assert stats.chunks_promoted == 1 and stats.chunks_loaded == {HOST: 1}


def test_chunks_fall_out_of_the_last_tier():
    with make_store(host_chunks=2, gpu_chunks=1) as store:
        for i in range(4):
            store.put(seq(i * 1000, CHUNK), make_kv(seq(i * 1000, CHUNK)))
        assert store.lookup(seq(0, CHUNK)).tokens == 0
        assert store.stats().drops == 1


@pytest.mark.parametrize("bad", [
    torch.zeros((2, 2, 32, 32), dtype=torch.float16),  # dtype
    torch.zeros((3, 2, 32, 32), dtype=torch.bfloat16),  # layers
    torch.zeros((2, 2, 32, 31), dtype=torch.bfloat16),  # hidden
    torch.zeros((2, 2, 16, 32), dtype=torch.bfloat16),  # too few tokens
])
def test_tensors_of_the_wrong_layout_are_refused(bad):
    with make_store() as store, pytest.raises(LayoutError, match="tensor of shape"):
        store.put(seq(0, 2 * CHUNK), bad)


def test_capacity_below_one_chunk_is_a_config_error():
    with pytest.raises(ConfigError, match="raise host_capacity or lower chunk_tokens"):
        KVStore(SMALL, {"chunk_tokens": CHUNK, "host_capacity": CHUNK_BYTES - 1}, model="m")


@pytest.mark.parametrize(("extra", "named"), [
    ({"gpu_capacity": CHUNK_BYTES - 1}, "raise gpu_capacity"),
    ({"disk_capacity": 1024}, "raise disk_capacity"),
    ({"disk_capacity": 8 * (4096 + CHUNK_BYTES), "share_writers": 16}, "lower\\s+share_writers"),
])
def test_a_tier_that_would_hold_no_chunk_is_a_config_error(tmp_path, extra, named):
    config = {"chunk_tokens": CHUNK, "host_capacity": 8 * CHUNK_BYTES,
              "disk_paths": [str(tmp_path)], **extra}
    with pytest.raises(ConfigError, match=named):
        KVStore(SMALL, config, model="m")
    assert not list(tmp_path.glob("*/writers/*"))  # nothing made, nothing held


def test_config_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVTIER_CHUNK_TOKENS", "32")
    monkeypatch.setenv("KVTIER_HOST_CAPACITY", "1MiB")
    monkeypatch.setenv("KVTIER_MODEL", "env-model")
    with KVStore(SMALL) as store:
        assert store.chunk_tokens == 32 and store.tiers[HOST].num_slots == 128


def test_threads_putting_and_getting_overlapping_prefixes_never_see_wrong_bytes():
    """Many threads, shared prefixes, a store much smaller than the data: every read is
    either a miss or exactly the bytes stored for that prefix."""
    store = make_store(host_chunks=12, gpu_chunks=4)
    roots = [seq(r * 10_000, 2 * CHUNK) for r in range(4)]
    errors: list[str] = []

    def work(worker: int) -> None:
        rng = np.random.default_rng(worker)
        for _ in range(150):
            root = roots[rng.integers(len(roots))]
            tail = [int(x) for x in rng.integers(0, 4, size=int(rng.integers(0, 3)) * CHUNK)]
            tokens = root + tail
            if rng.random() < 0.5:
                store.put(tokens, make_kv(tokens))
            else:
                n, out = read(store, tokens)
                if n % CHUNK or not same_bytes(out[:, :, :n], make_kv(tokens)[:, :, :n]):
                    errors.append(f"worker {worker}: wrong bytes for {n} tokens")

    threads = [threading.Thread(target=work, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert errors == []
    with bookkeeping(store) as stack:
        indexes = stack.indexes.values()
        assert all(i.free_slots + len(i) == i.num_slots for i in indexes), "slot leaked"
    assert store.stats().chunks_loaded.total() > 0
    store.close()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn", "int8"])
def test_every_bit_pattern_comes_back_through_host_device_pool_and_disk(tmp_path, dtype):
    """Copies move bytes: NaN payloads, negative zeros and subnormals come back bit for bit
    from the device pool, host memory and disk alike (a converting copy may not)."""
    from kvtier.io.buffers import align_up
    from kvtier.layout import KVLayout

    layout = KVLayout(num_layers=2, kv_heads=2, head_size=16, dtype=dtype)
    tokens = list(range(3 * CHUNK))
    raw = np.frombuffer(np.random.default_rng(7).bytes(len(tokens) * layout.token_bytes),
                        dtype=np.uint8).copy()  # every bit pattern of the dtype, NaNs included
    raw = torch.from_numpy(raw)
    kv = raw.view(getattr(torch, dtype)).view(layout.shape(len(tokens)))
    slot = align_up(layout.token_bytes * CHUNK)
    cfg = {"chunk_tokens": CHUNK, "gpu_capacity": slot, "host_capacity": 2 * slot,
           "disk_paths": [str(tmp_path)], "disk_capacity": 8 * (4096 + slot),
           "disk_min_free": 0, "model": "bits"}
    with KVStore(layout, cfg) as store:
        for end in range(CHUNK, len(tokens) + 1, CHUNK):  # one chunk at a time, each written
            store.put(tokens[:end], kv)
            assert store.flush()
        assert store.lookup(tokens).chunks_by_tier == {GPU: 1, HOST: 2}
        out = torch.zeros_like(kv)
        assert store.get(tokens, out) == len(tokens)
        assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    with KVStore(layout, cfg) as store:  # after a restart: every chunk comes from disk
        assert store.lookup(tokens).chunks_by_tier == {TierName.DISK: 3}
        out = torch.zeros_like(kv)
        assert store.get(tokens, out) == len(tokens)
        assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_flush_writes_device_pool_chunks_to_disk_and_leaves_host_memory_as_it_was(tmp_path, policy):
    first, second = seq(0, 4 * CHUNK), seq(10_000, 4 * CHUNK)
    disk = {"disk_paths": [str(tmp_path)], "disk_capacity": "1MiB", "disk_min_free": 0,
            "write_policy": policy}
    with make_store(host_chunks=4, gpu_chunks=4, **disk) as store:
        store.put(first, make_kv(first))
        store.put(second, make_kv(second))  # the first prefix moves down to host memory
        assert store.lookup(first).chunks_by_tier == {HOST: 4}
        assert store.lookup(second).chunks_by_tier == {GPU: 4}
        flushed = store.flush(timeout=10)
        assert flushed and flushed.not_written == 0 and flushed.written >= 4
        assert store.lookup(first).chunks_by_tier == {HOST: 4}  # not pushed out to disk
        assert store.lookup(second).chunks_by_tier == {GPU: 4}
        with bookkeeping(store) as stack:
            assert all(index.census().writing == 0 for index in stack.indexes.values())
    with make_store(host_chunks=8, **disk) as store:  # "if store.flush():" meant persisted
        for tokens in (first, second):
            n, out = read(store, tokens)
            assert n == len(tokens) and same_bytes(out, make_kv(tokens))



@pytest.mark.parametrize("fields", [(2.5, 2, 16), ("2", 2, 16), (True, 2, 16), (2, 0, 16),
                                    (2, 2, None)])
def test_a_layout_of_anything_but_positive_integers_is_refused_by_name(fields):
    from kvtier.layout import KVLayout

    with pytest.raises(LayoutError, match="must be a positive integer"):
        KVLayout(*fields)
    assert KVLayout(np.int64(2), 2, 16) == KVLayout(2, 2, 16)  # integer scalars are ints
    with pytest.raises(LayoutError, match=r"dtype torch\.bfloat16 not supported"):
        KVLayout(2, 2, 16, torch.bfloat16)
    with pytest.raises(LayoutError, match="must be a KVLayout"):
        KVStore({"num_layers": 2}, {"chunk_tokens": CHUNK, "host_capacity": "1MiB"}, model="m")


@pytest.mark.parametrize("device, says", [("meta", "holds no data"), ("bogus", "not a torch device"),
                                          ("cuda", "sees no CUDA device")])
def test_a_device_pool_on_a_device_it_cannot_use_is_a_config_error(device, says):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=says):
        KVStore(SMALL, {"chunk_tokens": CHUNK, "host_capacity": 4 * CHUNK_BYTES,
                        "gpu_capacity": 4 * CHUNK_BYTES}, model="m", device=device)


def test_a_put_longer_than_the_store_keeps_its_prefix_rather_than_evicting_it():
    with make_store(host_chunks=4) as store:
        tokens = seq(0, 8 * CHUNK)
        assert store.put(tokens, make_kv(tokens)) == 4 * CHUNK
        assert store.lookup(tokens).tokens == 4 * CHUNK  # the first four: a hit
        assert store.stats().chunks_skipped == 4
        n, out = read(store, tokens)
        assert n == 4 * CHUNK and same_bytes(out[:, :, :n], make_kv(tokens)[:, :, :n])


def test_a_flush_of_device_pool_chunks_on_a_hung_disk_holds_nothing_once_it_answers(tmp_path):
    from tests.helpers.fake_io import FakeEngine

    make, engines = FakeEngine.factory()
    tokens = seq(0, 2 * CHUNK)
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 4 * CHUNK_BYTES,
           "gpu_capacity": 4 * CHUNK_BYTES, "disk_paths": [str(tmp_path)],
           "disk_capacity": "1MiB", "disk_min_free": 0, "load_timeout": 0.2}
    with KVStore(SMALL, cfg, model="m", io_engine=make) as store:
        store.put(tokens, make_kv(tokens))
        engines[0].hold()
        assert not store.flush(timeout=2)  # writes left running past load_timeout
        engines[0].release()
        assert engines[0].drain(timeout=10)
        with bookkeeping(store) as stack:
            census = [index.census() for index in stack.indexes.values()]
        assert all(c.writing == 0 and c.pins == 0 for c in census), census
        assert store.flush(timeout=10)
