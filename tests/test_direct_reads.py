"""Reads straight into the caller's tensor: ``KVStore.empty_kv`` and ``DirectBuffer``."""

from __future__ import annotations

import gc
import re
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import KVLayout, KVStore
from kvtier.errors import LayoutError, StoreClosedError
from kvtier.io.buffers import PAGE
from kvtier.io.direct_buffer import DirectBuffers, Rows
from kvtier.store.direct import _rows_of, claim
from kvtier.tiers.base import TierName
from tests.helpers.fake_io import FakeEngine
from tests.helpers.kv import make_kv, same_bytes

# 2 layers, 2 KV heads x 32 dims, bf16: a 32-token chunk is one page per layer and K or V
LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_size=32, dtype="bfloat16")
CHUNK = 32
CHUNK_BYTES = LAYOUT.token_bytes * CHUNK
TOKENS = list(range(1000, 1000 + 4 * CHUNK))
DISK, HOST = TierName.DISK, TierName.HOST


def config(root, **extra) -> dict:
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 16 * CHUNK_BYTES, "disk_paths": [str(root)],
           "disk_capacity": 64 * (4096 + CHUNK_BYTES), "disk_min_free": 0, "io_threads": 2}
    cfg.update(extra)
    return cfg


def stored_on_disk(root, tokens=TOKENS, layout=LAYOUT, **extra) -> torch.Tensor:
    kv = make_kv(tokens, layout)
    with KVStore(layout, config(root, **extra), model="m") as store:
        store.put(tokens, kv)
        assert store.flush(timeout=10)
    return kv


def direct_buffers() -> int:
    """Mappings of direct buffers this process holds (caller's and alias)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if re.search(r"memfd:kvtier-direct", line))


def test_empty_kv_rows_start_on_pages_and_hold_zeros(tmp_path):
    with KVStore(LAYOUT, config(tmp_path), model="m") as store:
        out = store.empty_kv(100)
    assert out.shape == LAYOUT.shape(100) and out.dtype == torch.bfloat16
    assert out.stride(3) == 1 and out.stride(2) == LAYOUT.hidden
    assert (out.stride(1) * out.element_size()) % PAGE == 0 and out.data_ptr() % PAGE == 0
    assert not out.view(torch.int16).any()
    with KVStore(LAYOUT, config(tmp_path), model="m") as store, \
            pytest.raises(ValueError, match="positive"):
        store.empty_kv(0)


def test_a_first_disk_read_lands_in_the_tensor_and_the_second_promotes(tmp_path):
    kv = stored_on_disk(tmp_path)
    with KVStore(LAYOUT, config(tmp_path), model="m") as store:
        out = store.empty_kv(len(TOKENS))
        assert store.get(TOKENS, out) == len(TOKENS) and same_bytes(out, kv)
        assert store.lookup(TOKENS).chunks_by_tier == {DISK: 4}  # no copy through host memory
        assert store.stats().disk_reads == 4
        out.view(torch.int16).fill_(0)
        assert store.get(TOKENS, out) == len(TOKENS) and same_bytes(out, kv)
        assert store.lookup(TOKENS).chunks_by_tier == {HOST: 4}  # read again: promoted
        out.view(torch.int16).fill_(0)
        assert store.get(TOKENS, out) == len(TOKENS) and same_bytes(out, kv)
        assert store.stats().disk_reads == 8


def test_a_plain_tensor_is_read_through_host_memory_and_promoted(tmp_path):
    kv = stored_on_disk(tmp_path)
    with KVStore(LAYOUT, config(tmp_path), model="m") as store:
        out = torch.zeros(LAYOUT.shape(len(TOKENS)), dtype=torch.bfloat16)
        assert store.get(TOKENS, out) == len(TOKENS) and same_bytes(out, kv)
        assert store.lookup(TOKENS).chunks_by_tier == {HOST: 4}


def test_a_view_of_the_tensor_is_read_into_directly(tmp_path):
    kv = stored_on_disk(tmp_path)
    with KVStore(LAYOUT, config(tmp_path), model="m") as store:
        big = store.empty_kv(3 * len(TOKENS))
        out = big[:, :, CHUNK:CHUNK + len(TOKENS)]  # starts a page into each row
        assert store.get(TOKENS, out) == len(TOKENS) and same_bytes(out, kv)
        assert store.lookup(TOKENS).chunks_by_tier == {DISK: 4}
        assert not big[:, :, :CHUNK].view(torch.int16).any()  # nothing outside the view
        assert not big[:, :, CHUNK + len(TOKENS):].view(torch.int16).any()


def test_rows_that_are_not_whole_pages_are_read_through_host_memory(tmp_path):
    narrow = KVLayout(num_layers=2, kv_heads=2, head_size=16, dtype="bfloat16")  # 2 KiB rows
    kv = stored_on_disk(tmp_path, layout=narrow)
    with KVStore(narrow, config(tmp_path), model="m") as store:
        out = store.empty_kv(len(TOKENS))
        assert store.get(TOKENS, out) == len(TOKENS) and same_bytes(out, kv)
        assert store.lookup(TOKENS).chunks_by_tier == {HOST: 4}


def test_compressed_slots_are_decoded_into_the_tensor(tmp_path):
    kv = stored_on_disk(tmp_path, compression="zstd")
    with KVStore(LAYOUT, config(tmp_path, compression="zstd"), model="m") as store:
        out = store.empty_kv(len(TOKENS))
        assert store.get(TOKENS, out) == len(TOKENS) and same_bytes(out, kv)
        assert store.lookup(TOKENS).chunks_by_tier == {DISK: 4}


def test_a_read_given_up_on_never_writes_into_the_callers_tensor(tmp_path):
    kv = stored_on_disk(tmp_path)
    make, engines = FakeEngine.factory()
    with KVStore(LAYOUT, config(tmp_path, load_timeout=0.2), model="m", io_engine=make) as store:
        out = store.empty_kv(len(TOKENS))
        engines[0].hold()
        # a hung drive: the read is given up on (one: its path stays in service)
        assert store.get(TOKENS[:CHUNK], out) == 0
        out.view(torch.int16).fill_(7)  # the caller uses its tensor again at once
        engines[0].release()  # the late read now runs, into the pages the caller left
        assert engines[0].drain(timeout=10)
        assert not store.stats().paths_down  # so the late read did read
        assert bool((out.view(torch.int16) == 7).all())
        assert store.stats().load_timeouts == 1
    with KVStore(LAYOUT, config(tmp_path), model="m") as store:  # the slots were never bad
        out = store.empty_kv(len(TOKENS))
        assert store.get(TOKENS, out) == len(TOKENS) and same_bytes(out, kv)


def test_a_tensor_whose_read_was_given_up_on_is_read_through_host_from_then_on(tmp_path):
    other = list(range(5000, 5000 + len(TOKENS)))
    stored_on_disk(tmp_path)
    kv = make_kv(other, LAYOUT)
    with KVStore(LAYOUT, config(tmp_path), model="m") as store:
        store.put(other, kv)
        assert store.flush(timeout=10)
    make, engines = FakeEngine.factory()
    with KVStore(LAYOUT, config(tmp_path, load_timeout=0.2), model="m", io_engine=make) as store:
        out = store.empty_kv(len(TOKENS))
        engines[0].hold()
        assert store.get(TOKENS[:CHUNK], out) == 0  # one read given up on: the path stays up
        engines[0].release()
        assert engines[0].drain(timeout=10)
        assert store.get(other, out) == len(other) and same_bytes(out, kv)
        assert store.lookup(other).chunks_by_tier == {HOST: 4}  # through host slots
        fresh = store.empty_kv(len(TOKENS))  # another buffer is read into directly
        assert store.get(other[:CHUNK], fresh) == CHUNK


def test_the_memory_goes_with_the_last_view(tmp_path):
    gc.collect()  # buffers of earlier tests go first
    with KVStore(LAYOUT, config(tmp_path), model="m") as store:
        before = direct_buffers()
        out = store.empty_kv(len(TOKENS))
        view = out[:, :, :CHUNK]
        assert direct_buffers() == before + 2
        del out
        gc.collect()
        assert direct_buffers() == before + 2  # the view still holds it
        del view
        gc.collect()
        assert direct_buffers() == before


def test_empty_kv_on_a_closed_store_is_refused(tmp_path):
    store = KVStore(LAYOUT, config(tmp_path), model="m")
    store.close()
    with pytest.raises(StoreClosedError):
        store.empty_kv(CHUNK)


def test_a_detached_range_no_longer_sees_the_alias():
    buffers = DirectBuffers()
    buffer = buffers.new(3 * PAGE)
    caller = buffer.array()
    caller[:] = 1
    assert bool((buffer.alias == 1).all())
    buffer.detach([(PAGE, PAGE)])
    buffer.alias[:] = 9  # a late read writing through the alias
    assert caller[0] == 9 and caller[2 * PAGE] == 9  # still shared
    assert not caller[PAGE:2 * PAGE].any()  # fresh pages: zeros, never the late bytes
    assert buffer.detached
    assert buffers.find(buffer.address + 10, 100) is not None
    assert buffers.find(buffer.address, 4 * PAGE) is None  # past its end
    with pytest.raises(ValueError, match="whole pages"):
        buffer.detach([(1, PAGE)])


def test_buffers_are_forgotten_once_freed():
    buffers = DirectBuffers()
    buffer = buffers.new(PAGE)
    address = buffer.address
    del buffer
    gc.collect()
    assert buffers.find(address, 1) is None
    assert np.frombuffer(buffers.new(PAGE).alias, dtype=np.uint8).size == PAGE


def test_a_buffer_freed_while_the_registry_is_busy_does_not_hang_it():
    buffers = DirectBuffers()
    view = buffers.new(PAGE).array()
    address = view.ctypes.data
    done = threading.Event()

    def free_inside():  # as a garbage collection inside find() would free a buffer
        nonlocal view
        with buffers._lock:  # white-box: the moment the registry holds its lock
            view = None
            gc.collect()
        done.set()

    worker = threading.Thread(target=free_inside, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert done.is_set(), "the registry waited on its own lock"
    assert buffers.find(address, 1) is None


def test_rows_that_overlap_are_read_through_host_and_the_cache_survives(tmp_path):
    kv = stored_on_disk(tmp_path)
    with KVStore(LAYOUT, config(tmp_path), model="m") as store:
        base = store.empty_kv(len(TOKENS))
        # each layer's K and V rows share half their memory: not read into directly
        out = torch.as_strided(base, base.shape,
                               (base.stride(0), base.stride(1) // 2, base.stride(2), 1))
        assert store.get(TOKENS, out) == len(TOKENS)
        assert store.stats().corruptions == 0
        assert store.lookup(TOKENS).chunks_by_tier == {HOST: 4}  # through host slots: promoted
        fresh = store.empty_kv(len(TOKENS))
        assert store.get(TOKENS, fresh) == len(TOKENS) and same_bytes(fresh, kv)


def test_an_out_that_requires_grad_is_refused_before_any_read(tmp_path):
    kv = stored_on_disk(tmp_path)
    with KVStore(LAYOUT, config(tmp_path), model="m") as store:
        out = torch.zeros(LAYOUT.shape(len(TOKENS)), dtype=torch.bfloat16, requires_grad=True)
        with pytest.raises(LayoutError, match="requires grad"):
            store.get(TOKENS, out)
        assert store.stats().chunks_loaded == {} and not out.detach().view(torch.int16).any()
        assert store.get(TOKENS, out.detach()) == len(TOKENS) and same_bytes(out.detach(), kv)


def test_an_out_whose_elements_share_memory_is_refused_before_any_read(tmp_path):
    kv = stored_on_disk(tmp_path)
    with KVStore(LAYOUT, config(tmp_path), model="m") as store:
        out = store.empty_kv(len(TOKENS))[:, :1].expand(-1, 2, -1, -1)  # K and V: one memory
        with pytest.raises(LayoutError, match=r"share memory.*torch\.empty"):
            store.get(TOKENS, out)
        assert store.stats().chunks_loaded == {} and store.stats().corruptions == 0
        fresh = store.empty_kv(len(TOKENS))
        assert store.get(TOKENS, fresh) == len(TOKENS) and same_bytes(fresh, kv)




def test_a_second_get_into_the_same_bytes_never_reports_pages_a_give_up_wiped(tmp_path):
    kv = stored_on_disk(tmp_path)
    make, engines = FakeEngine.factory()
    with KVStore(LAYOUT, config(tmp_path, load_timeout=0.6), model="m", io_engine=make) as store:
        out = store.empty_kv(len(TOKENS))
        got: dict[str, int] = {}

        def get(name: str) -> None:
            got[name] = store.get(TOKENS[:CHUNK], out)

        engines[0].hold()
        first = threading.Thread(target=get, args=("first",))
        second = threading.Thread(target=get, args=("second",))
        first.start()
        time.sleep(0.3)
        second.start()  # into the same bytes, while the first one's read hangs
        time.sleep(0.45)  # the first gave up (its pages detached); the second is not over
        engines[0].release()
        first.join(10)
        second.join(10)
        assert got["first"] == 0
        # whatever the second reports loaded is in the tensor
        assert got["second"] == 0 or same_bytes(out[:, :, :CHUNK], kv[:, :, :CHUNK])


def test_claims_on_overlapping_bytes_wait_for_each_other_and_disjoint_ones_do_not():
    buffers = DirectBuffers()
    order: list[str] = []
    with buffers.claim(Rows(0, 8192, 1, 8192)):
        with buffers.claim(Rows(8192, 4096, 1, 4096)):  # disjoint: at once
            order.append("disjoint")
        waiter = threading.Thread(target=lambda: (buffers.claim(Rows(4096, 8192, 1, 8192)).__enter__(),
                                                  order.append("overlapping")))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and order == ["disjoint"]  # waits while the first is held
    waiter.join(10)
    assert order == ["disjoint", "overlapping"]


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 40), st.integers(0, 40), st.integers(1, 12), st.integers(1, 5),
       st.integers(1, 5), st.integers(1, 12), st.integers(1, 12))
def test_rows_overlap_exactly_when_they_share_a_byte(a, b, stride, count_a, count_b, length_a,
                                                     length_b):
    one, two = Rows(a, stride, count_a, length_a), Rows(b, stride, count_b, length_b)

    def taken(rows: Rows) -> set[int]:
        return {rows.start + i * rows.stride + j for i in range(rows.count) for j in range(rows.length)}

    shared = bool(taken(one) & taken(two))
    assert one.overlaps(two) == two.overlaps(one)
    assert one.overlaps(two) >= shared  # never misses a shared byte
    if max(length_a, length_b) <= stride:
        assert one.overlaps(two) == shared  # and exact for rows no longer than their stride


def test_gets_into_disjoint_token_slices_of_one_tensor_do_not_wait_for_each_other(tmp_path):
    """Claims were whole spans: every slice of one empty_kv tensor crosses the others' rows,
    so gets into disjoint slices ran one after another (six of them waited up to six
    load_timeouts on a slow drive). A claim is now the slice's own rows."""
    with KVStore(LAYOUT, config(tmp_path), model="m") as store:
        out = store.empty_kv(4 * CHUNK)
        first, second = _rows_of(out[:, :, :2 * CHUNK]), _rows_of(out[:, :, 2 * CHUNK:])
        assert first.count == second.count == 2 * LAYOUT.num_layers
        assert not first.overlaps(second) and first.overlaps(_rows_of(out))
        got: list[int] = []
        with claim(store._direct, out[:, :, :2 * CHUNK]):  # a get into the first half runs
            other = threading.Thread(target=lambda: got.append(
                store.get(list(range(2 * CHUNK)), out[:, :, 2 * CHUNK:])))
            other.start()  # a get into the other half does not wait for it
            other.join(10)
            assert not other.is_alive() and got == [0]


@pytest.mark.parametrize("bad", [10.5, "10", None, True, 1.0])
def test_empty_kv_of_anything_but_a_positive_integer_is_refused_by_name(tmp_path, bad):
    with KVStore(LAYOUT, config(tmp_path), model="m") as store:
        with pytest.raises(ValueError, match="must be a positive integer"):
            store.empty_kv(bad)
        with pytest.raises(ValueError, match="more than this machine's memory"):
            store.empty_kv(2**55)
        assert store.empty_kv(np.int64(40)).shape == LAYOUT.shape(40)
