"""Populating the pages a copy is about to write: what becomes resident, what stays as it was."""

from __future__ import annotations

import errno
import mmap

import numpy as np
import pytest
import torch

from kvtier.io import populate as pop
from kvtier.io.populate import PAGE, Populated, page_spans, populate, populating, resident

pytestmark = pytest.mark.skipif(not pop.supported(), reason="kernel without MADV_POPULATE_WRITE")


def fresh(pages: int) -> np.ndarray:
    """``pages`` pages of anonymous memory never touched (none resident)."""
    array = np.frombuffer(mmap.mmap(-1, pages * PAGE), dtype=np.uint8)
    assert not any(resident_pages(array))
    return array


def resident_pages(array: np.ndarray) -> list[bool]:
    base = array.ctypes.data
    return [resident(base + i * PAGE) for i in range(array.nbytes // PAGE)]


def test_a_fresh_buffer_is_resident_after_and_still_zeros():
    array = fresh(64)
    assert populate(array) is Populated.POPULATED
    assert all(resident_pages(array))
    assert not array.any()


def test_a_fresh_torch_tensor_is_resident_after():
    # 64 MiB: past glibc's largest mmap threshold (32 MiB), so new memory, never touched, even
    # where the process freed large blocks before (smaller ones may reuse resident heap)
    # where the allocator still hands back memory touched before, it is left as it was
    tensor = torch.empty((4, 2, 4096, 1024), dtype=torch.bfloat16)
    raw = tensor.view(torch.uint8).numpy().reshape(-1)
    first = -(-raw.ctypes.data // PAGE) * PAGE
    last = (raw.ctypes.data + raw.nbytes) // PAGE * PAGE - PAGE
    touched = all(resident(a) for a in (first, (first + last) // 2 // PAGE * PAGE, last))
    assert populate(tensor) is (Populated.RESIDENT if touched else Populated.POPULATED)
    assert all(resident(a) for a in range(first, raw.ctypes.data + raw.nbytes - PAGE, PAGE))


def test_only_the_rows_of_a_view_are_populated():
    array = fresh(4 * 2 * 8).reshape(4, 2, 8, PAGE)  # (layers, K/V, 8 one-page tokens)
    view = array[:, :, :3]
    assert populate(view) is Populated.POPULATED
    for layer in range(4):
        for kind in range(2):
            pages = resident_pages(array[layer, kind].reshape(-1))
            assert pages == [True] * 3 + [False] * 5


def test_bytes_already_there_are_left_as_they_were():
    array = np.frombuffer(mmap.mmap(-1, 16 * PAGE), dtype=np.uint8)
    array[: 8 * PAGE] = np.arange(8 * PAGE, dtype=np.uint8)  # half touched, half fresh
    assert populate(array) is Populated.POPULATED  # (reading them first would map them)
    assert np.array_equal(array[: 8 * PAGE], np.arange(8 * PAGE, dtype=np.uint8))
    assert not array[8 * PAGE:].any()


def test_resident_memory_is_left_alone():
    tensor = torch.zeros((2, 2, 64, 256), dtype=torch.float16)
    assert populate(tensor) is Populated.RESIDENT


def test_empty_views_and_device_tensors_are_nothing_to_do():
    assert populate(torch.empty((2, 2, 0, 8))) is Populated.EMPTY
    assert populate(torch.empty((2, 2, 16, 8), device="meta")) is Populated.NOT_HERE
    assert page_spans(torch.empty(4, device="meta")) is None


def test_a_kernel_without_populate_write_leaves_the_pages_to_the_copy(monkeypatch):
    monkeypatch.setattr(pop, "supported", lambda: False)
    array = fresh(8)
    assert populate(array) is Populated.UNSUPPORTED
    assert not any(resident_pages(array))
    array[:] = 7  # the copy faults them in itself
    assert (array == 7).all()


def test_pages_the_kernel_refuses_are_left_to_the_copy(monkeypatch):
    monkeypatch.setattr(pop, "madvise", lambda *args: errno.EINVAL)
    assert populate(fresh(8)) is Populated.FAILED


def test_the_probe_tells_a_kernel_without_it(monkeypatch):
    monkeypatch.setattr(pop, "madvise", lambda *args: errno.EINVAL)
    assert pop._Support()() is False
    monkeypatch.setattr(pop, "madvise", lambda *args: 0)
    assert pop._Support()() is True


def test_spans_are_whole_pages_and_neighbours_merge():
    tensor = torch.empty((4, 2, 512, 1024), dtype=torch.bfloat16)
    assert len(page_spans(tensor)) == 1  # contiguous: one span
    spans = page_spans(tensor[:, :, :100])  # a row per (layer, K/V), 1 MiB apart
    assert len(spans) == 8 and not (spans % PAGE).any()
    assert (np.diff(spans[:, 0]) == 512 * 1024 * 2).all()


def test_non_contiguous_and_reversed_views_cover_their_elements():
    array = fresh(32).view(np.int16).reshape(64, 1024)  # 2 KiB rows, two a page
    for view in (array.T, array[::-1], array[:, ::3], array[::4]):
        spans = page_spans(view)
        assert spans is not None
        offsets = np.asarray([np.dot(i, view.strides) for i in np.ndindex(view.shape)])
        addresses = np.unique((view.__array_interface__["data"][0] + offsets) // PAGE * PAGE)
        covered = [any(s <= a < e for s, e in spans.tolist()) for a in addresses]
        assert all(covered)


def test_too_many_rows_become_one_span_from_first_to_last():
    array = fresh(2 * pop.MAX_SPANS // 8)  # 8 rows a page
    view = array.reshape(-1, PAGE // 8)[:, ::2]  # every row in pieces: too many to name
    spans = page_spans(view)
    assert spans is not None and len(spans) == 1
    assert populate(view) is Populated.POPULATED and all(resident_pages(array))


def test_populating_populates_each_view_it_hands_out():
    array = fresh(8).reshape(8, PAGE)
    seen = []
    chunks = populating(lambda first, count: seen.append((first, count)) or array[first:first + count])
    run = chunks(2, 3)
    assert seen == [(2, 3)] and run.base is not None and np.shares_memory(run, array)
    assert resident_pages(array.reshape(-1)) == [False] * 2 + [True] * 3 + [False] * 3


def fresh_tensor(layout, tokens: int) -> torch.Tensor:
    """A KV tensor on anonymous memory never touched (what a new ``torch.empty`` is)."""
    shape = layout.shape(tokens)
    size = int(np.prod(shape)) * 2
    memory = mmap.mmap(-1, -(-size // PAGE) * PAGE)
    return torch.frombuffer(memory, dtype=torch.bfloat16, count=size // 2).view(shape)


def stored(root, tokens, **extra):
    from kvtier import KVStore
    from tests.helpers.kv import SMALL, make_kv
    from tests.helpers.store import config

    with KVStore(SMALL, config(root, **extra)) as store:
        store.put(tokens, make_kv(tokens))
        assert store.flush(timeout=10)
    return KVStore(SMALL, config(root, **extra))


def test_a_get_populates_each_run_of_a_fresh_tensor_before_its_copy(tmp_path, monkeypatch):
    from tests.helpers.kv import SMALL, make_kv, same_bytes
    from tests.helpers.store import seq

    seen: list[Populated] = []
    real = pop.populate
    monkeypatch.setattr(pop, "populate", lambda view: seen.append(real(view)) or seen[-1])
    tokens = seq(0, 8)
    with stored(tmp_path, tokens) as store:
        out = fresh_tensor(SMALL, len(tokens) + 64)  # room past the prefix: never populated
        assert store.get(tokens, out) == len(tokens)
        assert same_bytes(out[:, :, :len(tokens)], make_kv(tokens))
        assert Populated.POPULATED in seen and Populated.UNSUPPORTED not in seen
        tail = out[:, :, len(tokens) + 16:].view(torch.uint8).numpy()
        assert not any(resident(int(a)) for a in np.unique(page_spans(tail)[:, 0]))
        seen.clear()
        assert store.get(tokens, out) == len(tokens)  # the same tensor again: resident
        assert seen and set(seen) == {Populated.RESIDENT}


def test_a_get_on_a_kernel_without_populate_write_fills_a_fresh_tensor(tmp_path, monkeypatch):
    from tests.helpers.kv import SMALL, make_kv, same_bytes
    from tests.helpers.store import seq

    monkeypatch.setattr(pop, "supported", lambda: False)
    tokens = seq(0, 8)
    with stored(tmp_path, tokens) as store:
        out = fresh_tensor(SMALL, len(tokens))
        assert store.get(tokens, out) == len(tokens)
        assert same_bytes(out, make_kv(tokens))
