"""The offline commands hold little per chunk of a segment: ``inspect`` its write time,
``verify`` nothing (the index is walked alongside the slots, never held whole), ``gc`` a few
numbers. A segment may hold millions of chunks; at hundreds of bytes a chunk (every index
entry a Python object, as they were held) a verify of a large cache took gigabytes.

Measured as the growth of the peak of what Python allocated (numpy's arrays included) from
a small cache to a larger one, per chunk more: the fixed costs (an index piece, imports,
listings) cancel out. Each command runs in a process of its own (``tests.helpers.peak_memory``),
reading the index in pieces far smaller than the caches."""

import pytest

from kvtier import KVStore
from kvtier.ops.cache import cache_root, namespaces
from kvtier.ops.inspect import inspect_namespace
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.peak_memory import peak
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


def per_chunk(command: str, caches) -> tuple[float, dict, dict]:
    small, large = (peak(command, root) for root in caches)
    return (large["peak"] - small["peak"]) / (LARGER - SMALLER), small, large


def test_inspect_holds_a_few_bytes_a_chunk(caches):
    grown, small, large = per_chunk("inspect", caches)
    assert small["chunks"] == SMALLER and large["chunks"] == LARGER  # every chunk counted
    [(oldest, median)] = large["ages"]
    assert oldest >= median > 0
    assert grown < 100, f"inspect held {grown:.0f} bytes a chunk"


def test_verify_holds_nothing_a_chunk(caches):
    grown, small, large = per_chunk("verify", caches)
    assert small["chunks"] == SMALLER and large["chunks"] == LARGER
    assert large["problems"] == 0
    assert grown < 20, f"verify held {grown:.0f} bytes a chunk"


def test_gc_holds_a_few_numbers_a_chunk(caches):
    grown, small, large = per_chunk("gc-dry", caches)
    assert small["chunks"] == SMALLER and large["chunks"] == LARGER  # every chunk chosen
    assert grown < 150, f"gc held {grown:.0f} bytes a chunk"


def test_a_gc_that_frees_every_chunk_holds_a_few_numbers_a_chunk(tmp_path):
    """Not a dry run: the slots chosen are checked against the index, the log started afresh
    without them, their entries blanked and their space punched out."""
    roots = build(tmp_path / "smaller", SMALLER), build(tmp_path / "larger", LARGER)
    grown, small, large = per_chunk("gc", roots)
    assert small["chunks"] == SMALLER and large["chunks"] == LARGER
    assert [inspect_namespace(d).chunks for d in namespaces(cache_root(roots[1]), None)] == [0]
    assert grown < 150, f"gc held {grown:.0f} bytes a chunk"
