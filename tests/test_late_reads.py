"""A disk read given up on (``load_timeout``, or past the end of a prefix) still runs: its
disk slot is held until it ends, so no chunk written meanwhile can land there and be found
by the late read as "another chunk", then blanked as corrupt."""

import torch

from kvtier import KVStore
from kvtier.io.format import HEADER_BYTES
from kvtier.tiers.base import TierName
from tests.helpers.fake_io import FakeEngine
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, bookkeeping, make_kv, same_bytes

DISK = TierName.DISK


def seq(start: int) -> list[int]:
    return list(range(start, start + CHUNK))


def get(store: KVStore, tokens: list[int]) -> int:
    out = torch.zeros(SMALL.shape(len(tokens)), dtype=torch.bfloat16)
    n = store.get(tokens, out)
    assert same_bytes(out[:, :, :n], make_kv(tokens)[:, :, :n])
    return n


def test_a_late_read_never_blanks_a_chunk_flushed_into_its_slot_since(tmp_path):
    """Write-back, host 2 slots, disk 4: get(A) gives up on A's held read; put(D) then
    wrote a host victim back into A's freed slot and flush() said it was on disk; A's late
    read found that chunk there, took it for corruption and blanked it: a miss at once, and
    gone after a restart."""
    cfg = {"chunk_tokens": CHUNK, "host_capacity": 2 * CHUNK_BYTES, "disk_paths": [str(tmp_path)],
           "disk_capacity": 4 * (HEADER_BYTES + CHUNK_BYTES), "disk_min_free": 0,
           "write_policy": "write_back", "io_threads": 1, "load_timeout": "300ms",
           "model": "late-read"}
    a, b, c, d = seq(1000), seq(2000), seq(3000), seq(4000)
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, cfg, io_engine=make) as store:
        for tokens in (a, b, c):  # a is written back to disk when c evicts it
            assert store.put(tokens, make_kv(tokens)) == CHUNK
        with bookkeeping(store) as stack:
            a_slot = stack.indexes[DISK].slot_of(store.keys(a)[0])
        reads = engines[0].queues[0]  # reads wait (a slow drive); write-back moves go on
        engines[0].hold(reads)
        try:
            assert get(store, a) == 0  # given up on after load_timeout
            assert store.put(d, make_kv(d)) == CHUNK  # a host victim is written back
            with bookkeeping(store) as stack:
                assert all(stack.indexes[DISK].slot_of(store.keys(t)[0]) != a_slot for t in (b, c))
        finally:
            engines[0].release(reads)
        assert engines[0].drain(timeout=10)
        assert store.flush(timeout=10)
        for tokens in (b, c, d):
            assert get(store, tokens) == CHUNK
        assert store.stats().corruptions == 0
    with KVStore(SMALL, cfg) as again:
        for tokens in (b, c, d):
            assert get(again, tokens) == CHUNK
