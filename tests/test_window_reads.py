"""Loads that need only some KV cache groups of a chunk: chunks on disk in parts, each checked
on its own (the slot's part table), read in part where a group's blocks are out of its window,
and not read at all where every group's are."""

import numpy as np
import pytest
import torch

from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.common.messages import (
    NULL_BLOCK,
    ChunkLoad,
    ChunkStore,
    RequestLoad,
    StepPlan,
    WorkerReport,
)
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.worker.side import WorkerSide
from kvtier.disk.tier import DiskTier
from kvtier.io.buffers import AlignedBuffer
from kvtier.io.format import (
    HEADER_BYTES,
    INDEX_ENTRY_BYTES,
    HeaderError,
    SlotHeader,
    decode_header,
    payload_checksum,
    payload_matches,
)
from kvtier.io.result import IOStatus
from kvtier.tiers.base import TierName
from tests.helpers.cli import as_json
from tests.helpers.disk_helpers import NS, chunk, key, slot_files
from tests.helpers.fake_io import FakeEngine
from tests.helpers.scheduler_side import Request, request
from tests.helpers.window import BLOCK, BLOCKS, CHUNK, HIDDEN, LAYERS, WORKER_GEO, same

PARTS = (8192, 4096)  # two groups' parts of a 12 KiB chunk
RAW = sum(PARTS)


def parted_tier(root, parts=PARTS, **kwargs) -> DiskTier:
    root.mkdir(mode=0o700, exist_ok=True)
    raw = sum(parts)
    return DiskTier([str(root)], NS, raw, 8 * (HEADER_BYTES + -(-raw // 4096) * 4096),
                    parts=parts, **kwargs)


def in_parts(data: np.ndarray, parts=PARTS) -> tuple[tuple[int, int], ...]:
    out, at = [], 0
    for size in parts:
        out.append((size, payload_checksum(data[at:at + size].data)))
        at += size
    return tuple(out)


def flip(root, offset: int) -> None:
    (path,) = slot_files(root)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


# -- the slot format ----------------------------------------------------------------------

def test_a_header_in_parts_round_trips_and_its_table_is_checked():
    data = chunk(1, RAW).array[:RAW]
    header = SlotHeader.in_parts(NS.digest(), key(1), in_parts(data), 5, 6)
    encoded = header.encode()
    back = decode_header(encoded)
    assert back.parts == in_parts(data) and back.num_parts == 2 and back.payload_bytes == RAW
    assert payload_matches(back, data.data)
    prefix = decode_header(encoded[:INDEX_ENTRY_BYTES])  # as the per-directory index keeps it
    assert prefix.num_parts == 2 and prefix.parts == ()
    with pytest.raises(ValueError, match="index entry"):
        payload_matches(prefix, data.data)
    torn = bytearray(encoded)
    torn[INDEX_ENTRY_BYTES + 9] ^= 1  # a part's checksum
    with pytest.raises(HeaderError, match="part table checksum"):
        decode_header(bytes(torn))
    with pytest.raises(ValueError, match="2 to"):
        SlotHeader.in_parts(NS.digest(), key(1), in_parts(data)[:1], 5, 6)


def test_every_part_of_a_payload_is_checked():
    data = chunk(1, RAW).array[:RAW].copy()
    header = decode_header(SlotHeader.in_parts(NS.digest(), key(1), in_parts(data), 5, 6).encode())
    for offset in (0, PARTS[0] - 1, PARTS[0], RAW - 1):
        bad = data.copy()
        bad[offset] ^= 1
        assert not payload_matches(header, bad.data), offset
    assert not payload_matches(header, data[:RAW - 1].data)


# -- the disk tier ------------------------------------------------------------------------

def test_a_part_is_read_alone_and_checked_alone(tmp_path):
    tier = parted_tier(tmp_path)
    data = chunk(1, RAW)
    assert tier.write(0, key(1), data.array).ok
    out = AlignedBuffer(RAW, pin=False)
    out.array[:] = 0xAA
    (result,) = tier.read_parts([(0, key(1), out.array, (1,))])
    assert result.ok and result.nbytes == HEADER_BYTES + PARTS[1]  # the header and part 1 only
    assert np.array_equal(out.array[PARTS[0]:RAW], data.array[PARTS[0]:RAW])
    assert (out.array[:PARTS[0]] == 0xAA).all()  # the rest of the slot is left as it was
    flip(tmp_path, HEADER_BYTES + 5)  # part 0 goes bad: part 1 still reads, the whole does not
    assert tier.read_parts([(0, key(1), out.array, (1,))])[0].ok
    assert tier.read_parts([(0, key(1), out.array, (0,))])[0].status is IOStatus.CORRUPT
    assert tier.read(0, key(1), out.array).status is IOStatus.CORRUPT
    assert tier.read_parts([(0, key(2), out.array, (1,))])[0].status is IOStatus.CORRUPT
    tier.close()


def test_every_part_is_read_whole_and_a_torn_table_is_corrupt(tmp_path):
    tier = parted_tier(tmp_path)
    data = chunk(2, RAW)
    tier.write(0, key(2), data.array)
    out = AlignedBuffer(RAW, pin=False)
    (result,) = tier.read_parts([(0, key(2), out.array, (0, 1))])
    assert result.ok and result.nbytes == HEADER_BYTES + RAW
    assert np.array_equal(out.array[:RAW], data.array[:RAW])
    flip(tmp_path, INDEX_ENTRY_BYTES + 20)  # the part table, outside the header's checksum
    assert tier.read_parts([(0, key(2), out.array, (1,))])[0].status is IOStatus.CORRUPT
    assert tier.read(0, key(2), out.array).status is IOStatus.CORRUPT
    tier.close()


def test_another_engines_chunk_is_read_in_part_too(tmp_path):
    from kvtier.disk.parts import ChunkParts
    from kvtier.shared.reads import OtherReads
    from kvtier.shared.view import SharedView

    tier = parted_tier(tmp_path, writers=["a"])
    data = chunk(6, RAW)
    tier.write(0, key(6), data.array)
    view = SharedView([str(tmp_path)], NS, RAW, ("b",), 30)
    view.refresh()
    reads = OtherReads([str(tmp_path)], NS, RAW, tier.stride, [False], ChunkParts(RAW, PARTS))
    ref = view.ref(view.find(key(6)))
    out = AlignedBuffer(RAW, pin=False)
    result = reads.read_parts(ref, out.array, (0,))
    assert result.ok and result.nbytes == HEADER_BYTES + PARTS[0]
    assert np.array_equal(out.array[:PARTS[0]], data.array[:PARTS[0]])
    flip(tmp_path, HEADER_BYTES + 1)  # its part 0: nothing of theirs is ever written or blanked
    assert reads.read_parts(ref, out.array, (0,)).status is IOStatus.CORRUPT
    assert reads.read_parts(ref, out.array, (1,)).ok
    reads.close()
    view.close()
    tier.close()


def test_parts_off_page_bounds_and_compressed_chunks_are_read_whole(tmp_path):
    odd = (8192 + 512, 4096)
    tier = parted_tier(tmp_path / "odd", parts=odd)
    assert not tier.parts.readable
    tier.write(0, key(3), chunk(3, sum(odd)).array)
    out = AlignedBuffer(sum(odd), pin=False)
    (result,) = tier.read_parts([(0, key(3), out.array, (1,))])
    assert result.ok and result.nbytes >= HEADER_BYTES + sum(odd)
    tier.close()
    packed = parted_tier(tmp_path / "zstd", compression=True)
    data = chunk(4, RAW)
    data.array[:RAW] = 7  # compresses: one payload, no parts
    packed.write(0, key(4), data.array)
    out = AlignedBuffer(RAW, pin=False)
    (result,) = packed.read_parts([(0, key(4), out.array, (1,))])
    assert result.ok and np.array_equal(out.array[:RAW], data.array[:RAW])
    packed.close()


def test_verify_checks_every_part_of_a_slot(tmp_path):
    tier = parted_tier(tmp_path)
    tier.write(0, key(5), chunk(5, RAW).array)
    tier.close()
    code, data = as_json("verify", tmp_path)
    assert code == 0 and data["namespaces"][0]["ok"] == 1
    flip(tmp_path, HEADER_BYTES + PARTS[0] + 7)  # part 1
    code, data = as_json("verify", tmp_path)
    assert code == 1 and data["namespaces"][0]["writers"][0]["corrupt"] == [0]


# -- planning a load ----------------------------------------------------------------------

GEO = KVGeometry(4, 4096, BLOCK, BLOCK, CHUNK, "bfloat16", "t", group_layers=(2, 2),
                 group_kinds=("full", "sliding32"))
ALL_SLIDING = KVGeometry(2, 4096, BLOCK, BLOCK, CHUNK, "bfloat16", "t",
                         group_kinds=("sliding32",))


def scheduler(tmp_path, geo=GEO, **extra) -> SchedulerSide:
    config = load_config({"chunk_tokens": geo.chunk_tokens, "host_capacity": 3 * geo.chunk_bytes,
                          "load_policy": "always", "disk_paths": [str(tmp_path)],
                          "disk_capacity": 16 * (4096 + geo.chunk_bytes), **extra}, environ={})
    return SchedulerSide(config, geo, [geo.namespace("m", "", 1, 0)], 1)


def stored_on_disk(side: SchedulerSide, req: Request, groups: int) -> None:
    """Store ``req``'s chunks (host and disk, as many steps as host memory needs), then push
    them out of host memory."""
    for r in (req, request("push", 3 * CHUNK, seed=9)):
        for _ in range(r.num_tokens // CHUNK):
            meta = StepPlan()
            ids = list(range(100, 100 + r.num_tokens // BLOCK))
            side.plan_stores(r, [ids] * groups, r.num_tokens, meta)
            done = {s.key: 1 for s in meta.stores}
            side.worker_report(WorkerReport(host_stored=done, disk_written=done))
    assert all(side.stack.locate(k).tier is TierName.DISK
               for k in side.chunk_keys(req, req.num_tokens // CHUNK))


def test_a_chunk_out_of_the_sliding_window_is_read_in_part_and_not_kept(tmp_path):
    side = scheduler(tmp_path)
    stored = request("a", 2 * CHUNK)
    stored_on_disk(side, stored, 2)
    again = Request("b", 2 * CHUNK + 1, stored.block_hashes)
    assert side.num_new_matched_tokens(again, 0) == (2 * CHUNK, True)
    sliding = [NULL_BLOCK, NULL_BLOCK, 23, 24, 25]  # chunk 0 is out of the window
    side.plan_load(again, ([11, 12, 13, 14, 15], sliding), 0, 2 * CHUNK)
    (load,) = side.build_meta().loads
    assert [c.parts for c in load.chunks] == [(0,), None]  # chunk 0: the full group's part
    assert side.counters["load_chunks_in_part"] == 1
    side.worker_report(WorkerReport(loads_done={"b": 1}))
    keys = side.chunk_keys(stored, 2)
    host = side.stack.indexes[TierName.HOST]
    assert not host.has_entry(keys[0])  # a slot holding one group's part is never a hit
    assert side.stack.locate(keys[1]).tier is TierName.HOST  # the whole chunk is promoted
    assert side.stack.locate(keys[0]).tier is TierName.DISK


def test_another_engines_chunk_out_of_the_window_is_read_in_part(tmp_path):
    a = scheduler(tmp_path, instance_id="a", share_writers=2)
    stored = request("a", 2 * CHUNK)
    meta = StepPlan()
    a.plan_stores(stored, [list(range(100, 104))] * 2, 2 * CHUNK, meta)
    disk = DiskTier([str(tmp_path)], GEO.namespace("m", "", 1, 0), GEO.chunk_bytes,
                    8 * (4096 + GEO.chunk_bytes), writers=["a"], share_writers=2,
                    parts=GEO.part_bytes)
    buffer = AlignedBuffer(GEO.chunk_bytes)
    assert all(disk.write(s.disk_slot, s.key, buffer.array).ok for s in meta.stores)
    disk.close()
    b = scheduler(tmp_path, instance_id="b", share_writers=2)
    again = Request("b", 2 * CHUNK + 1, stored.block_hashes)
    assert b.num_new_matched_tokens(again, 0) == (2 * CHUNK, True)
    b.plan_load(again, ([11, 12, 13, 14, 15], [NULL_BLOCK, NULL_BLOCK, 23, 24, 25]), 0, 2 * CHUNK)
    (load,) = b.build_meta().loads
    assert [c.other is not None for c in load.chunks] == [True, True]
    assert [c.parts for c in load.chunks] == [(0,), None]
    b.worker_report(WorkerReport(loads_done={"b": 1}))
    host = b.stack.indexes[TierName.HOST]
    assert [c.key in host for c in load.chunks] == [False, True]  # a part is never kept
    a.close()
    b.close()


def test_a_chunk_out_of_every_window_is_a_hit_with_nothing_to_read(tmp_path):
    side = scheduler(tmp_path, ALL_SLIDING)
    stored = request("a", 3 * CHUNK)
    stored_on_disk(side, stored, 1)
    again = Request("b", 3 * CHUNK + 1, stored.block_hashes)
    assert side.num_new_matched_tokens(again, 0) == (3 * CHUNK, True)
    window = [NULL_BLOCK] * 4 + [25, 26, 27]  # chunks 0 and 1 left the window
    side.plan_load(again, (window,), 0, 3 * CHUNK)
    (load,) = side.build_meta().loads
    assert [c.fills_nothing for c in load.chunks] == [True, True, False]
    assert [c.host_slot is None for c in load.chunks] == [True, True, False]
    assert side.load_tiers("b", 3 * CHUNK) == {TierName.DISK: 3 * CHUNK, TierName.HOST: 0}
    assert side.counters["load_chunks_out_of_window"] == 2
    disk = side.stack.indexes[TierName.DISK]
    assert not any(disk.pinned(k) for k in side.chunk_keys(stored, 2))


def test_a_hit_longer_than_host_memory_needs_slots_for_its_window_only(tmp_path):
    side = scheduler(tmp_path, ALL_SLIDING)  # 3 host slots
    stored = request("a", 6 * CHUNK)
    stored_on_disk(side, stored, 1)
    again = Request("b", 6 * CHUNK + 1, stored.block_hashes)
    assert side.num_new_matched_tokens(again, 0) == (6 * CHUNK, True)  # not cut at 3 chunks
    side.plan_load(again, ([NULL_BLOCK] * 10 + [31, 32, 33],), 0, 6 * CHUNK)
    (load,) = side.build_meta().loads
    assert [c.host_slot is not None for c in load.chunks] == [False] * 5 + [True]


def test_a_chunk_longer_than_the_window_is_warned_of(tmp_path, caplog):
    longer = KVGeometry(2, 4096, BLOCK, BLOCK, 2 * CHUNK, "bfloat16", "t",
                        group_kinds=("sliding32",))
    straddling = KVGeometry(2, 4096, BLOCK, BLOCK, 48, "bfloat16", "t", group_kinds=("local64",))
    assert GEO.unstored_replies() is None  # a chunk as long as the window
    assert "longer than a sliding window (32" in longer.unstored_replies()
    assert "does not divide the local attention chunk (64" in straddling.unstored_replies()
    assert KVGeometry(2, 4096, BLOCK, BLOCK, 32, "bfloat16", "t",
                      group_kinds=("local64",)).unstored_replies() is None
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with caplog.at_level("WARNING", logger="kvtier"):
        scheduler(tmp_path / "a", GEO).close()
        assert "chunk completed while decoding" not in caplog.text
        scheduler(tmp_path / "b", longer).close()
    assert "chunk_tokens (64) is longer than a sliding window (32 tokens): a chunk" in caplog.text


def test_a_shared_hit_longer_than_host_memory_needs_slots_for_its_window_only(tmp_path):
    a = scheduler(tmp_path, ALL_SLIDING, instance_id="a", share_writers=2,
                  host_capacity=6 * ALL_SLIDING.chunk_bytes)  # room to store all six at once
    stored = request("a", 6 * CHUNK)
    meta = StepPlan()
    a.plan_stores(stored, [list(range(100, 112))], 6 * CHUNK, meta)
    assert len(meta.stores) == 6
    disk = DiskTier([str(tmp_path)], ALL_SLIDING.namespace("m", "", 1, 0),
                    ALL_SLIDING.chunk_bytes, 16 * (4096 + ALL_SLIDING.chunk_bytes),
                    writers=["a"], share_writers=2)
    buffer = AlignedBuffer(ALL_SLIDING.chunk_bytes)
    assert all(disk.write(s.disk_slot, s.key, buffer.array).ok for s in meta.stores)
    disk.close()
    b = scheduler(tmp_path, ALL_SLIDING, instance_id="b", share_writers=2)  # 3 host slots
    again = Request("b", 6 * CHUNK + 1, stored.block_hashes)
    assert b.num_new_matched_tokens(again, 0) == (6 * CHUNK, True)
    b.plan_load(again, ([NULL_BLOCK] * 10 + [31, 32, 33],), 0, 6 * CHUNK)
    (load,) = b.build_meta().loads
    assert [c.host_slot is not None for c in load.chunks] == [False] * 5 + [True]
    assert [c.other is not None for c in load.chunks] == [False] * 5 + [True]
    assert b.load_tiers("b", 6 * CHUNK) == {TierName.DISK: 6 * CHUNK, TierName.HOST: 0}
    a.close()
    b.close()


def test_a_cut_hit_is_not_moved_onto_chunks_without_slots(tmp_path):
    """With every host slot pinned, a sliding hit cut before its last chunk would end where
    the chunks before it come into the window and need slots too: nothing loads."""
    side = scheduler(tmp_path, ALL_SLIDING, staging_wait="off")
    stored = request("a", 6 * CHUNK)
    stored_on_disk(side, stored, 1)
    held = request("held", 3 * CHUNK, seed=7)
    meta = StepPlan()
    side.plan_stores(held, [list(range(100, 106))], 3 * CHUNK, meta)  # back into host memory
    side.worker_report(WorkerReport(host_stored={s.key: 1 for s in meta.stores},
                                    disk_written={s.key: 1 for s in meta.stores}))
    holder = Request("h", 3 * CHUNK + 1, held.block_hashes)
    assert side.num_new_matched_tokens(holder, 0) == (3 * CHUNK, True)
    side.plan_load(holder, ([201, 202, 203, 204, 205, 206, 207],), 0, 3 * CHUNK)  # pins 3
    assert side.stack.indexes[TierName.HOST].reusable_slots == 0
    again = Request("b", 6 * CHUNK + 1, stored.block_hashes)
    assert side.num_new_matched_tokens(again, 0) == (0, False)


@pytest.mark.parametrize(("kinds", "end", "kept"), [
    (("full",), 100, [0]),
    (("sliding32",), 100, [69]),  # the last 31 computed tokens and the next one
    (("sliding32",), 20, [0]),
    (("local64",), 100, [64]),  # the current attention chunk
    (("sliding32", "full"), 100, [69, 0]),
])
def test_each_group_keeps_what_vllm_keeps(kinds, end, kept):
    geo = KVGeometry(2 * len(kinds), 4096, BLOCK, BLOCK, CHUNK, "bfloat16", "t",
                     group_layers=(2,) * len(kinds) if len(kinds) > 1 else (),
                     group_kinds=kinds)
    assert geo.kept_from(end) == kept


def test_tokens_vllm_retains_past_the_window_are_kept_too():
    geo = KVGeometry(2, 4096, BLOCK, BLOCK, CHUNK, "bfloat16", "t", group_kinds=("sliding32",),
                     retained_tokens=5)
    assert geo.kept_from(100) == [64]


def test_the_bytes_a_load_needs_are_the_parts_of_groups_keeping_its_blocks():
    part = GEO.part_bytes[0]
    assert GEO.part_bytes == (part, part) and 2 * part == GEO.chunk_bytes
    # a hit of 4 chunks (128 tokens): the window (32) keeps tokens 97 on, blocks 96 on
    assert [GEO.bytes_needed(c, 128) for c in range(4)] == [part, part, part, 2 * part]
    assert GEO.bytes_needed(2, 113) == 2 * part  # kept from token 82: block 80..95 holds it
    assert [ALL_SLIDING.bytes_needed(c, 128) for c in range(4)] == [0, 0, 0, ALL_SLIDING.chunk_bytes]


# -- the worker ---------------------------------------------------------------------------


def parted_worker(tmp_path, **extra) -> tuple[WorkerSide, list[torch.Tensor]]:
    config = load_config({"chunk_tokens": CHUNK, "host_capacity": 4 * WORKER_GEO.chunk_bytes,
                          "disk_paths": [str(tmp_path)], "disk_min_free": 0,
                          "disk_capacity": 8 * (4096 + WORKER_GEO.chunk_bytes), **extra},
                         environ={})
    make, _ = FakeEngine.factory()
    side = WorkerSide(config, WORKER_GEO, WORKER_GEO.namespace("m", "", 1, 0), io_engine=make)
    kv = list(torch.randn(LAYERS, BLOCKS, 2, BLOCK, HIDDEN).to(torch.bfloat16).unbind(0))
    side.register({f"layer{i}": t for i, t in enumerate(kv)})
    return side, kv


def damage_sliding_part(root, writer: str = "*") -> None:
    """Flip a byte of the sliding group's part of the chunk in disk slot 2."""
    (path,) = root.glob(f"*/writers/{writer}/slots-*.kvt")
    data = bytearray(path.read_bytes())
    at = 2 * (HEADER_BYTES + WORKER_GEO.chunk_bytes) + HEADER_BYTES + WORKER_GEO.part_bytes[0]
    data[at + 3] ^= 0x10
    path.write_bytes(bytes(data))


def test_the_worker_reads_only_the_parts_a_load_fills(tmp_path):
    side, kv = parted_worker(tmp_path)
    original = [t.clone() for t in kv]
    side.save(StepPlan(stores=[ChunkStore(b"k" * 16, (3, 4, 5, 6), host_slot=0, disk_slot=2)]))
    side.drain()
    assert side.report().disk_written[b"k" * 16] == 1
    damage_sliding_part(tmp_path)  # this load does not read it
    for t in kv:
        t[8:12].zero_()
    chunk_load = ChunkLoad(b"k" * 16, (8, 9, NULL_BLOCK, NULL_BLOCK), 0, host_slot=1,
                           disk_slot=2, parts=(0,))
    side.start_loads(StepPlan(loads=[RequestLoad("r", (chunk_load,), asynchronous=True)]))
    side.drain()
    assert side.finished() == {"r"} and side.take_failed_loads() == set()
    assert all(same(kv[i][8:10], original[i][3:5]) for i in (0, 1))  # the full group's layers
    assert all(same(kv[i][NULL_BLOCK], original[i][NULL_BLOCK]) for i in range(LAYERS))
    assert side.stats().data["disk_read_bytes"] == HEADER_BYTES + WORKER_GEO.part_bytes[0]
    (sample,) = side.report().load_samples  # the auto policy's measure: the bytes read
    assert sample[0] == HEADER_BYTES + WORKER_GEO.part_bytes[0]
    whole = ChunkLoad(b"k" * 16, (8, 9, 10, 11), 0, host_slot=1, disk_slot=2)
    side.start_loads(StepPlan(loads=[RequestLoad("s", (whole,), asynchronous=True)]))
    side.drain()
    assert side.finished() == {"s"} and side.take_failed_loads() == {"s"}  # the bad part
    side.close()


def test_the_worker_reads_another_engines_chunk_in_part(tmp_path):
    from kvtier.shared.view import SharedView

    a, kv_a = parted_worker(tmp_path, instance_id="a", share_writers=2)
    a.save(StepPlan(stores=[ChunkStore(b"k" * 16, (3, 4, 5, 6), host_slot=0, disk_slot=2)]))
    a.drain()
    damage_sliding_part(tmp_path, "a")
    view = SharedView([str(tmp_path)], WORKER_GEO.namespace("m", "", 1, 0),
                      WORKER_GEO.chunk_bytes, ("b",), 30)
    view.refresh()
    ref = view.ref(view.find(b"k" * 16))
    b, kv_b = parted_worker(tmp_path, instance_id="b", share_writers=2)
    theirs = ChunkLoad(b"k" * 16, (8, 9, NULL_BLOCK, NULL_BLOCK), 0, host_slot=1,
                       other=(ref,), parts=(0,))
    b.start_loads(StepPlan(loads=[RequestLoad("r", (theirs,), asynchronous=True)]))
    b.drain()
    assert b.finished() == {"r"} and b.take_failed_loads() == set()
    assert all(same(kv_b[i][8:10], kv_a[i][3:5]) for i in (0, 1))
    assert b.stats().data["disk_read_bytes"] == HEADER_BYTES + WORKER_GEO.part_bytes[0]
    for side in (a, b):
        side.close()
    view.close()


def test_a_chunk_that_fills_nothing_is_stepped_over_and_a_cut_after_it_still_fails(tmp_path):
    side, kv = parted_worker(tmp_path)
    original = [t.clone() for t in kv]
    side.save(StepPlan(stores=[ChunkStore(b"k" * 16, (3, 4, 5, 6), host_slot=0, disk_slot=2)]))
    side.drain()
    nothing = ChunkLoad(b"n" * 16, (NULL_BLOCK,) * 4, 0, None)  # out of every window
    hit = ChunkLoad(b"k" * 16, (8, 9, 10, 11), 0, host_slot=0)
    side.start_loads(StepPlan(loads=[RequestLoad("r", (nothing, hit), asynchronous=True)]))
    side.drain()
    assert side.finished() == {"r"} and side.take_failed_loads() == set()
    assert all(same(kv[i][8:10], original[i][3:5]) for i in (0, 1))
    assert all(same(kv[i][10:12], original[i][5:7]) for i in (2, 3))
    cut = ChunkLoad(b"k" * 16, (12, 13, 14, 15), 0, None)  # no host slot was free for it
    side.start_loads(StepPlan(loads=[RequestLoad("s", (nothing, cut), asynchronous=True)]))
    side.drain()
    assert side.finished() == {"s"} and side.take_failed_loads() == {"s"}  # recomputed whole
    side.close()


def test_the_groups_a_load_fills_are_those_with_a_block_in_it():
    assert GEO.groups_filled((11, 12, NULL_BLOCK, NULL_BLOCK)) == (0,)
    assert GEO.groups_filled((NULL_BLOCK, NULL_BLOCK, 13, 14)) == (1,)
    assert GEO.groups_filled((11, 12, NULL_BLOCK, 14)) is None  # every group: read whole
    assert GEO.groups_filled((NULL_BLOCK,) * 4) == ()  # a chunk that fills nothing
    assert ALL_SLIDING.groups_filled((NULL_BLOCK, 3)) is None  # one group: never in part
