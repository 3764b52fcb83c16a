"""Chunks copied in runs: a put's chunks bound for slots that follow one another
(``kvtier/store/puts.py``), and a get's chunks held in slots that follow one another
(``PrefixRead``), go in one copy each; the right bytes in every slot and every place of the
caller's tensor, and no reservation left behind when a copy or a demotion fails."""

import pytest
import torch

from kvtier import KVLayout, KVStore
from kvtier.tiers.base import TierName
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, bookkeeping, make_kv, same_bytes

HOST, DISK = TierName.HOST, TierName.DISK
# 3 tokens of 96 bytes: a 288-byte chunk in a 4096-byte slot, so a run's rows are strided
ODD = KVLayout(num_layers=1, kv_heads=3, head_size=8, dtype="float16")


def make_store(tmp_path=None, host_chunks=8, layout=SMALL, chunk=CHUNK, **extra) -> KVStore:
    config = {"chunk_tokens": chunk, "host_capacity": host_chunks * 4096, "io_threads": 4,
              **extra}
    if tmp_path is not None:
        config.update(disk_paths=[str(tmp_path)], disk_capacity=64 * (4096 + 4096),
                      disk_min_free=0)
    return KVStore(layout, config, model="test-model")


def count_copies(store, monkeypatch) -> list[int]:
    """The chunks each copy of a run moved, in order (white-box: the runner)."""
    copies: list[int] = []
    runner = store._runner
    real = runner.copy

    def counted(target, source):
        copies.append(target.shape[0])
        real(target, source)

    monkeypatch.setattr(runner, "copy", counted)
    return copies


def read(store, tokens, layout=SMALL):
    out = torch.zeros(layout.shape(len(tokens)), dtype=getattr(torch, layout.dtype))
    return store.get(tokens, out), out


def reservations(store) -> int:
    """Slots reserved and never finished, over every tier."""
    with bookkeeping(store) as stack:
        return sum(index.census().writing for index in stack.indexes.values())


def test_chunks_into_slots_in_order_go_in_one_copy(monkeypatch):
    with make_store() as store:
        copies = count_copies(store, monkeypatch)
        tokens = list(range(6 * CHUNK))
        assert store.put(tokens, make_kv(tokens)) == 6 * CHUNK
        assert copies == [6]
        n, out = read(store, tokens)
        assert n == 6 * CHUNK and same_bytes(out, make_kv(tokens))


def test_a_chunk_already_cached_splits_the_run(monkeypatch):
    with make_store() as store:
        tokens = list(range(5 * CHUNK))
        kv = make_kv(tokens)
        store.put(tokens[:3 * CHUNK], kv)  # chunks 0-2 in slots 0-2
        with bookkeeping(store) as stack:
            stack.discard(store.keys(tokens)[1])  # chunk 1's slot is free again
        copies = count_copies(store, monkeypatch)
        assert store.put(tokens, kv) == 3 * CHUNK
        assert copies == [1, 2]  # chunk 1 (slot 1), then chunks 3-4 (slots 3-4)
        n, out = read(store, tokens)
        assert n == 5 * CHUNK and same_bytes(out, kv)


def test_slots_out_of_order_are_copied_one_run_each(monkeypatch):
    with make_store(host_chunks=4) as store:
        first = list(range(4 * CHUNK))
        store.put(first, make_kv(first))  # slots 0-3, in that order
        store.get(first[:CHUNK], torch.zeros(SMALL.shape(CHUNK), dtype=torch.bfloat16))
        # chunk 0 is now the most recent: the next put evicts 1, 2, 3, then 0
        copies = count_copies(store, monkeypatch)
        second = list(range(1000, 1000 + 4 * CHUNK))
        assert store.put(second, make_kv(second)) == 4 * CHUNK
        assert copies == [3, 1]
        n, out = read(store, second)
        assert n == 4 * CHUNK and same_bytes(out, make_kv(second))


def test_a_put_larger_than_the_top_tier_stores_every_chunk_in_turn(monkeypatch):
    # a device pool of 4 above host memory of 8: the run held fills the pool, is copied in,
    # then its chunks move down to make room for the next run
    with make_store(host_chunks=8, gpu_capacity=4 * 4096) as store:
        copies = count_copies(store, monkeypatch)
        tokens = list(range(8 * CHUNK))
        kv = make_kv(tokens)
        assert store.put(tokens, kv) == 8 * CHUNK
        assert sum(copies) == 8 and max(copies) <= 4
        assert store.lookup(tokens).chunks_by_tier == {TierName.GPU: 4, HOST: 4}
        n, out = read(store, tokens)
        assert n == len(tokens) and same_bytes(out, kv)


def test_a_put_longer_than_every_tier_stores_its_first_chunks_only():
    with make_store(host_chunks=4) as store:
        tokens = list(range(10 * CHUNK))
        kv = make_kv(tokens)
        assert store.put(tokens, kv) == 4 * CHUNK
        with bookkeeping(store) as stack:
            held = [stack.locate(key) for key in store.keys(tokens)]
        assert [loc is not None for loc in held] == [True] * 4 + [False] * 6
        for i in range(4):  # the first four chunks, each in its own slot
            slot = store._state.transfers.view(held[i]).view(torch.bfloat16)
            assert same_bytes(slot, kv[:, :, i * CHUNK:(i + 1) * CHUNK])


def test_a_run_is_at_most_run_bytes(monkeypatch):
    monkeypatch.setattr("kvtier.store.puts.RUN_BYTES", 3 * CHUNK_BYTES)
    with make_store() as store:
        copies = count_copies(store, monkeypatch)
        tokens = list(range(8 * CHUNK))
        assert store.put(tokens, make_kv(tokens)) == 8 * CHUNK
        assert copies == [3, 3, 2]


@pytest.mark.parametrize("policy, runs", [("write_through", [2, 2, 2]), ("write_back", [6])])
def test_runs_are_short_while_each_chunk_starts_a_background_write(tmp_path, monkeypatch,
                                                                   policy, runs):
    monkeypatch.setattr("kvtier.store.puts.RUN_BYTES_WRITING", 2 * CHUNK_BYTES)
    with make_store(tmp_path, write_policy=policy) as store:
        copies = count_copies(store, monkeypatch)
        tokens = list(range(6 * CHUNK))
        assert store.put(tokens, make_kv(tokens)) == 6 * CHUNK
        assert copies == runs
        assert store.flush().not_written == 0


def test_runs_of_chunks_smaller_than_their_slots_land_in_the_right_rows(monkeypatch):
    with make_store(layout=ODD, chunk=3) as store:
        copies = count_copies(store, monkeypatch)
        tokens = list(range(7 * 3))
        kv = make_kv(tokens, ODD)
        assert store.put(tokens, kv) == 7 * 3
        assert copies == [7]
        n, out = read(store, tokens, ODD)
        assert n == 7 * 3 and same_bytes(out, kv)


def test_a_failed_copy_leaves_no_reservation_and_the_store_goes_on(monkeypatch):
    with make_store() as store:
        runner = store._runner
        real = runner.copy

        def broken(target, source):
            raise RuntimeError("copy failed")

        monkeypatch.setattr(runner, "copy", broken)
        tokens = list(range(4 * CHUNK))
        with pytest.raises(RuntimeError, match="copy failed"):
            store.put(tokens, make_kv(tokens))
        assert reservations(store) == 0 and store.lookup(tokens).tokens == 0
        monkeypatch.setattr(runner, "copy", real)
        assert store.put(tokens, make_kv(tokens)) == 4 * CHUNK
        assert same_bytes(read(store, tokens)[1], make_kv(tokens))


def test_a_demotion_that_raises_fails_the_run_held_before_it(tmp_path, monkeypatch):
    with make_store(tmp_path, host_chunks=4, write_policy="write_back") as store:
        first = list(range(4 * CHUNK))
        store.put(first, make_kv(first))  # slots 0-3, evicted in that order
        runner = store._runner
        real, moves = runner._move, []

        def move(step, running):
            moves.append(step)
            done = real(step, running)  # finishes the move's own reservation
            if len(moves) == 2:
                raise OSError("demotion failed")
            return done

        monkeypatch.setattr(runner, "_move", move)
        copies = count_copies(store, monkeypatch)
        second = list(range(1000, 1000 + 4 * CHUNK))
        with pytest.raises(OSError, match="demotion failed"):
            store.put(second, make_kv(second))  # chunk 0 held for slot 0; 1's demotion fails
        assert copies == [] and reservations(store) == 0
        assert store.lookup(second).tokens == 0
        monkeypatch.setattr(runner, "_move", real)
        assert store.put(second, make_kv(second)) == 4 * CHUNK
        n, out = read(store, second)
        assert n == 4 * CHUNK and same_bytes(out, make_kv(second))


# -- get ------------------------------------------------------------------------------------


def count_copies_out(store, monkeypatch) -> list[int]:
    """The chunks each copy out of memory slots moved, in order (white-box: the transfers)."""
    copies: list[int] = []
    transfers = store._state.transfers
    real = transfers.run_of

    def counted(first, count):
        copies.append(count)
        return real(first, count)

    monkeypatch.setattr(transfers, "run_of", counted)
    return copies


@pytest.mark.parametrize("host_chunks, chunks, runs", [(16, 6, [6]), (8, 8, [4, 4])])
def test_a_get_of_chunks_in_slots_in_order_copies_each_read_window_out_in_one_copy(
        monkeypatch, host_chunks, chunks, runs):
    with make_store(host_chunks=host_chunks) as store:  # a read window of host_chunks / 2
        tokens = list(range(chunks * CHUNK))
        store.put(tokens, make_kv(tokens))
        copies = count_copies_out(store, monkeypatch)
        n, out = read(store, tokens)
        assert n == chunks * CHUNK and same_bytes(out, make_kv(tokens))
        assert copies == runs


def test_a_get_of_chunks_in_slots_out_of_order_copies_each_run_to_its_place(monkeypatch):
    with make_store(host_chunks=4) as store:
        first = list(range(4 * CHUNK))
        store.put(first, make_kv(first))  # slots 0-3
        read(store, first[:CHUNK])  # chunk 0 the most recent: the next put evicts 1, 2, 3, 0
        second = list(range(1000, 1000 + 4 * CHUNK))
        store.put(second, make_kv(second))  # chunks 0-2 in slots 1-3, chunk 3 in slot 0
        copies = count_copies_out(store, monkeypatch)
        n, out = read(store, second)
        assert n == 4 * CHUNK and same_bytes(out, make_kv(second))
        assert copies == [2, 1, 1]  # a read window of 2 chunks: slots 1-2, then 3, then 0


def test_a_run_copied_out_of_host_memory_is_promoted_chunk_by_chunk(monkeypatch):
    with make_store(host_chunks=12, gpu_capacity=4 * CHUNK_BYTES) as store:
        tokens = list(range(8 * CHUNK))
        kv = make_kv(tokens)
        store.put(tokens, kv)  # chunks 0-3 demoted to host slots 0-3 as 4-7 came in
        other = list(range(10_000, 10_000 + 4 * CHUNK))
        store.put(other, make_kv(other))  # and 4-7 to host slots 4-7 as these came in
        assert store.lookup(tokens).chunks_by_tier == {HOST: 8}  # 4 host slots free
        copies = count_copies_out(store, monkeypatch)
        n, out = read(store, tokens)
        assert n == 8 * CHUNK and same_bytes(out, kv)
        assert copies[0] > 1  # a run of host slots, copied out at once
        # each promoted in turn over the other prefix's chunks (moved down to the free host
        # slots); then the device pool holds only this get's chunks, which its promotions do
        # not evict
        assert store.stats().chunks_promoted == 4
        assert store.lookup(tokens).chunks_by_tier == {TierName.GPU: 4, HOST: 4}
        assert store.lookup(other).chunks_by_tier == {HOST: 4}
        n, out = read(store, tokens)  # every chunk still right wherever it went
        assert n == 8 * CHUNK and same_bytes(out, kv)
