"""The offline commands hold little per chunk of a segment: ``inspect`` its write time,
``verify`` nothing (the index is walked alongside the slots, never held whole), ``gc`` a few
numbers. A segment may hold millions of chunks; at hundreds of bytes a chunk (every index
entry a Python object, as they were held) a verify of a large cache took gigabytes.

Measured by ``tracemalloc`` (numpy's arrays included) as the growth of the peak from a
small cache to a larger one, per chunk more: the fixed costs (an index piece, imports,
listings) cancel out. The index is read, and gc's write times looked at, in small pieces
here, so that a piece holds far fewer entries than the caches do."""

import tracemalloc

import pytest

from kvtier import KVStore
from kvtier.ops import segments, slot_freeing, victims
from kvtier.ops.cache import cache_root, namespaces
from kvtier.ops.inspect import inspect_namespace
from kvtier.ops.reclaim import gc
from kvtier.ops.verify import verify_namespace
from kvtier.segment import index_file
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.store import config

SMALLER, LARGER = 400, 2400
PUT_CHUNKS = 200  # chunks a put


def build(root, chunks: int):
    root.mkdir(mode=0o700)
    with KVStore(SMALL, config(root, host_chunks=PUT_CHUNKS, disk_chunks=chunks + 8)) as store:
        for first in range(0, chunks, PUT_CHUNKS):
            tokens = list(range(10**6 + first * CHUNK, 10**6 + (first + PUT_CHUNKS) * CHUNK))
            store.put(tokens, make_kv(tokens))
            assert store.flush()
    return root


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    where = tmp_path_factory.mktemp("memory")
    return build(where / "smaller", SMALLER), build(where / "larger", LARGER)


def peak(operation, root) -> int:
    dirs = namespaces(cache_root(root), None)
    tracemalloc.start()
    try:
        result = operation(dirs)
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def per_chunk(operation, caches, monkeypatch) -> float:
    monkeypatch.setattr(index_file, "INDEX_PIECE_ENTRIES", 64)
    monkeypatch.setattr(victims, "BLOCK", 64)
    (small, small_result), (large, large_result) = (peak(operation, root) for root in caches)
    return (large - small) / (LARGER - SMALLER), small_result, large_result


def test_inspect_holds_a_few_bytes_a_chunk(caches, monkeypatch):
    grown, small, large = per_chunk(lambda dirs: [inspect_namespace(d) for d in dirs], caches,
                                    monkeypatch)
    assert small[0].chunks == SMALLER and large[0].chunks == LARGER  # every chunk counted
    assert large[0].age_seconds["max"] >= large[0].age_seconds["median"] > 0
    assert grown < 100, f"inspect held {grown:.0f} bytes a chunk"


def test_verify_holds_nothing_a_chunk(caches, monkeypatch):
    grown, small, large = per_chunk(lambda dirs: [verify_namespace(d) for d in dirs], caches,
                                    monkeypatch)
    assert small[0].writers[0].ok == SMALLER and large[0].writers[0].ok == LARGER
    assert not large[0].problems
    assert grown < 20, f"verify held {grown:.0f} bytes a chunk"



def test_gc_holds_a_few_numbers_a_chunk(caches, monkeypatch):
    grown, small, large = per_chunk(lambda dirs: gc(dirs, target_bytes=0, dry_run=True), caches,
                                    monkeypatch)
    assert small.chunks_freed == SMALLER and large.chunks_freed == LARGER  # every chunk chosen
    assert grown < 100, f"gc held {grown:.0f} bytes a chunk"


def test_a_gc_that_frees_every_chunk_holds_a_few_numbers_a_chunk(tmp_path, monkeypatch):
    """Not a dry run: the slots chosen are checked against the index, the log started afresh
    without them, their entries blanked and their space punched out."""
    roots = build(tmp_path / "smaller", SMALLER), build(tmp_path / "larger", LARGER)
    monkeypatch.setattr(slot_freeing, "BLOCK", 64)
    monkeypatch.setattr(segments, "LOG_BLOCK", 64)
    grown, small, large = per_chunk(lambda dirs: gc(dirs, target_bytes=0), roots, monkeypatch)
    assert small.chunks_freed == SMALLER and large.chunks_freed == LARGER
    assert [inspect_namespace(d).chunks for d in namespaces(cache_root(roots[1]), None)] == [0]
    assert grown < 100, f"gc held {grown:.0f} bytes a chunk"
