"""KVStore at its public edge: bad input gets a clear error, a failed start leaves nothing
held, and flush() puts every host chunk on disk."""

import socket
import threading
import urllib.request

import pytest
import torch

import kvtier.store.assembly as assembly_module
from kvtier import KVStore
from kvtier.errors import ConfigError, LayoutError, StoreClosedError, TokenError
from kvtier.tiers.base import TierName
from kvtier.tiers.host import physical_memory
from tests.helpers.disk_helpers import delayed_io
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, make_kv
from tests.helpers.store import config, exact, load, seq

HOST, DISK = TierName.HOST, TierName.DISK


def no_model(path, **extra):
    return {k: v for k, v in config(path, **extra).items() if k != "model"}


def test_a_store_without_a_model_name_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="model"):
        KVStore(SMALL, no_model(tmp_path))
    assert not list(tmp_path.iterdir())  # refused before anything was made


def test_the_model_comes_from_config_or_the_argument(tmp_path):
    tokens = seq(0, 2)
    with KVStore(SMALL, {**no_model(tmp_path), "model": "org/a"}) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
    with KVStore(SMALL, no_model(tmp_path), model="org/b") as b:
        assert b.lookup(tokens).tokens == 0  # same layout, another model: nothing shared
    with KVStore(SMALL, no_model(tmp_path), model="org/a") as a:
        assert exact(a, tokens) == 2 * CHUNK


def test_token_ids_outside_int64_are_an_error(tmp_path):
    with KVStore(SMALL, config(tmp_path)) as store:
        store.put([-1] * CHUNK, make_kv([-1] * CHUNK))
        huge = [2**64 - 1] * CHUNK  # wrapped, it would be the key of [-1] * 16
        for call in (lambda: store.lookup(huge), lambda: store.put(huge, make_kv([0] * CHUNK)),
                     lambda: load(store, huge), lambda: store.lookup([2**63] * CHUNK),
                     lambda: store.lookup([1.5] * CHUNK)):
            with pytest.raises(TokenError):
                call()
        assert store.lookup([-1] * CHUNK).tokens == CHUNK


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_metrics_endpoint_listens_on_loopback_unless_told_otherwise(tmp_path):
    port = _free_port()
    with KVStore(SMALL, config(tmp_path, metrics_port=port)) as store:
        assert store._metrics._server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            assert b"kvtier_" in answer.read()
    port = _free_port()
    with KVStore(SMALL, config(tmp_path, metrics_port=port, metrics_host="0.0.0.0")) as store:
        assert store._metrics._server.server_address[0] == "0.0.0.0"


def test_a_failed_start_leaves_no_lock_and_names_the_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"metrics_port={port}"):
            KVStore(SMALL, config(tmp_path, metrics_port=port))
    with KVStore(SMALL, config(tmp_path)) as again:  # a leaked lock would refuse the disk
        assert not again.disk.down_paths


def host_tiers_made(monkeypatch) -> list:
    """Every host tier a store makes from now on (white-box: its buffer's mapping)."""
    made = []
    real = assembly_module.make_host_tier

    def recording(*args):
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(assembly_module, "make_host_tier", recording)
    return made


@pytest.mark.parametrize("disk", [True, False])
def test_host_memory_is_unmapped_at_close(tmp_path, monkeypatch, disk):
    made = host_tiers_made(monkeypatch)
    cfg = config(tmp_path) if disk else {"chunk_tokens": CHUNK, "host_capacity": 4 * CHUNK_BYTES}
    with KVStore(SMALL, cfg, model="m") as store:  # put and get: views of host slots made
        store.put(seq(0, 2), make_kv(seq(0, 2)))
        assert exact(store, seq(0, 2)) == 2 * CHUNK
    assert made and made[0].buffer._mmap.closed  # no view of it left to keep it mapped


def test_a_failed_start_unmaps_host_memory(tmp_path, monkeypatch):
    made = host_tiers_made(monkeypatch)
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="metrics_port"):
            KVStore(SMALL, config(tmp_path, metrics_port=taken.getsockname()[1]))
    assert made and made[0].buffer._mmap.closed


def test_host_capacity_above_memory_names_the_key():
    with pytest.raises(ConfigError, match="host_capacity"):
        KVStore(SMALL, {"chunk_tokens": CHUNK, "host_capacity": 2 * physical_memory()},
                model="m")


def test_calls_after_close_are_a_clear_error(tmp_path):
    store = KVStore(SMALL, config(tmp_path))
    store.put(seq(0, 1), make_kv(seq(0, 1)))
    assert store.close() and store.close()  # closing twice is fine
    for call in (lambda: store.put(seq(0, 1), make_kv(seq(0, 1))), lambda: load(store, seq(0, 1)),
                 lambda: store.lookup(seq(0, 1)), store.flush):
        with pytest.raises(StoreClosedError, match="closed"):
            call()


def test_flush_writes_what_a_burst_of_puts_dropped(tmp_path, monkeypatch):
    tokens = [seq(i * 1000, 1) for i in range(32)]
    with KVStore(SMALL, config(tmp_path, host_chunks=32, io_threads=1)) as store:
        delayed_io(monkeypatch, "pwritev", seconds=0.02)  # a burst faster than the disk
        for t in tokens:
            store.put(t, make_kv(t))
        assert store.stats().dropped_writes > 0
        flushed = store.flush()
        assert flushed and flushed.not_written == 0
    with KVStore(SMALL, config(tmp_path, host_chunks=2)) as again:
        assert again.stats().recovered_chunks == 32
        assert all(exact(again, t) == CHUNK for t in tokens)


def test_flush_says_how_many_it_could_not_write(tmp_path):
    with KVStore(SMALL, config(tmp_path, host_chunks=8, disk_chunks=3)) as store:
        store.put(seq(0, 6), make_kv(seq(0, 6)))
        flushed = store.flush()
        # the disk holds 3 chunks: the others stay in host memory only
        assert not flushed and flushed.not_written == 3 and not flushed.timed_out


def test_flush_meanwhile_puts_in_other_threads(tmp_path):
    with KVStore(SMALL, config(tmp_path, host_chunks=16, disk_chunks=256)) as store:
        stop = threading.Event()

        def put_forever():
            i = 0
            while not stop.is_set() and i < 2000:
                store.put(seq(10_000 + i * 100, 1), make_kv(seq(10_000 + i * 100, 1)))
                i += 1

        worker = threading.Thread(target=put_forever)
        worker.start()
        try:
            for _ in range(5):
                assert not store.flush(timeout=30).timed_out
        finally:
            stop.set()
            worker.join(timeout=60)
        assert store.flush(timeout=30)


def test_chunk_bytes_of_the_test_layout():
    assert CHUNK_BYTES == 4096  # the figures above assume one page per chunk


def test_flush_without_a_disk_tier_says_nothing_is_persisted():
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 8 * CHUNK_BYTES, "model": "m"}
    with KVStore(SMALL, cfg) as store:
        assert store.flush()  # nothing held, nothing lost
        store.put(seq(0, 4), make_kv(seq(0, 4)))
        flushed = store.flush()
        assert not flushed and flushed.not_written == 4 and flushed.written == 0


def test_counters_and_metrics_stay_readable_after_close(tmp_path):
    store = KVStore(SMALL, config(tmp_path, share_refresh="1s"))
    store.put(seq(0, 2), make_kv(seq(0, 2)))
    assert store.close()
    assert store.stats().chunks_stored == 2  # the last counters
    assert store.writers() == []
    assert any(sample.name == "chunks_stored_total" for sample in store.metric_samples())


def test_chunks_read_from_disk_into_host_memory_count_as_promoted(tmp_path):
    tokens = seq(0, 4)
    with KVStore(SMALL, config(tmp_path, host_chunks=8)) as store:
        store.put(tokens, make_kv(tokens))
        assert store.flush()
    with KVStore(SMALL, config(tmp_path, host_chunks=8)) as store:
        assert exact(store, tokens) == 4 * CHUNK
        stats = store.stats()
        assert stats.chunks_loaded == {DISK: 4} and stats.chunks_promoted == 4
        assert store.lookup(tokens).chunks_by_tier == {HOST: 4}
        assert exact(store, tokens) == 4 * CHUNK  # from host now: nothing more to promote
        assert store.stats().chunks_promoted == 4


@pytest.mark.parametrize("given", [lambda kv: kv.numpy(), lambda kv: kv.tolist()],
                         ids=["numpy", "list"])
def test_a_kv_that_is_not_a_tensor_is_a_layout_error(given):
    tokens = seq(0, 1)
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 8 * CHUNK_BYTES, "model": "m"}
    not_a_tensor = given(make_kv(tokens).view(torch.int16))
    kind = type(not_a_tensor).__name__
    with KVStore(SMALL, cfg) as store:
        with pytest.raises(LayoutError, match=f"kv must be a torch.Tensor .*got a .*{kind}"):
            store.put(tokens, not_a_tensor)
        with pytest.raises(LayoutError, match=f"out must be a torch.Tensor .*got a .*{kind}"):
            store.get(tokens, not_a_tensor)


@pytest.mark.parametrize("given", [lambda kv: kv.to_sparse(), lambda kv: kv.to("meta")],
                         ids=["sparse", "meta"])
def test_a_kv_without_dense_memory_is_a_layout_error(given):
    tokens = seq(0, 1)
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 8 * CHUNK_BYTES, "model": "m"}
    with KVStore(SMALL, cfg) as store:
        for call in (store.put, store.get):
            with pytest.raises(LayoutError, match="must be a dense tensor with memory"):
                call(tokens, given(make_kv(tokens)))
