"""In vLLM: an engine's scheduler side finds chunks other engines wrote to a shared
directory, plans their loads from there, and its workers read them, verified."""

import contextlib
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

from kvtier.connector.common.messages import ChunkLoad, RequestLoad, StepPlan, WorkerReport
from kvtier.tiers.base import TierName
from tests.helpers.scheduler_side import request, scheduler, store_all, write_as
from tests.helpers.worker_side import GEO, LAYERS, same, worker

ROOT = Path(__file__).resolve().parents[1]


def test_a_chunk_only_another_engine_wrote_is_loaded_from_its_segment(tmp_path):
    a = scheduler(disk=tmp_path, instance_id="a", share_writers=2)
    write_as(tmp_path, "a", store_all(a, request("x", 64)).stores)
    b = scheduler(disk=tmp_path, instance_id="b", share_writers=2)
    assert b.recovered == 0 and b.others.counts().chunks == 2
    assert b.num_new_matched_tokens(request("y", 65), 0) == (64, True)  # asynchronous
    b.plan_load(request("y", 65), ([1, 2, 3, 4, 5],), 0, 64)
    assert b.load_tiers("y", 64) == {TierName.DISK: 64, TierName.HOST: 0}
    (load,) = b.build_meta().loads
    assert all(c.other is not None and c.other[0].writer == "a" and c.host_slot is not None
               and c.disk_slot is None for c in load.chunks)
    b.worker_report(WorkerReport(loads_done=Counter({"y": 1})))
    host = b.stack.indexes[TierName.HOST]
    assert all(c.key in host for c in load.chunks)  # now in b's own host memory
    a.close()
    b.close()


def test_a_copy_a_rank_found_bad_is_forgotten(tmp_path):
    a = scheduler(disk=tmp_path, instance_id="a", share_writers=2)
    write_as(tmp_path, "a", store_all(a, request("x", 64)).stores)
    b = scheduler(disk=tmp_path, instance_id="b", share_writers=2)
    b.num_new_matched_tokens(request("y", 65), 0)
    b.plan_load(request("y", 65), ([1, 2, 3, 4, 5],), 0, 64)
    (load,) = b.build_meta().loads
    bad = load.chunks[1].key
    b.worker_report(WorkerReport(load_failed={"y": {bad}}, other_bad={bad},
                                 loads_done=Counter({"y": 1})))
    assert b.counters["load_failed_chunks"] == 1 and b.others.find(bad) is None
    assert b.num_new_matched_tokens(request("z", 65), 0) == (32, False)  # the first, from host
    b.close()
    a.close()


def test_with_tensor_parallel_every_rank_must_hold_the_chunk(tmp_path):
    a = scheduler(world=2, disk=tmp_path, instance_id="a", share_writers=2)
    stores = store_all(a, request("x", 64), world=2).stores
    write_as(tmp_path, "a", stores, world=2, ranks=[0])  # rank 1 never wrote them
    b = scheduler(world=2, disk=tmp_path, instance_id="b", share_writers=2)
    assert b.num_new_matched_tokens(request("y", 65), 0) == (0, False)
    b.close()
    write_as(tmp_path, "a", stores, world=2, ranks=[1])
    b = scheduler(world=2, disk=tmp_path, instance_id="b", share_writers=2)
    assert b.num_new_matched_tokens(request("y", 65), 0) == (64, True)
    b.plan_load(request("y", 65), ([1, 2, 3, 4, 5],), 0, 64)
    (load,) = b.build_meta().loads
    assert all(len(c.other) == 2 for c in load.chunks)
    b.close()
    a.close()


def test_a_chunk_written_again_elsewhere_after_one_rank_failed_is_found(tmp_path):
    """(rank 1's write of a chunk failed and took its path out; the producer wrote the chunk
    again, every rank, to another slot: rank 0's first copy is the old one, which rank 1
    lacks; the copy every rank holds is found)"""
    import dataclasses

    a = scheduler(world=2, disk=tmp_path, instance_id="a", share_writers=2)
    stores = store_all(a, request("x", 64), world=2).stores
    write_as(tmp_path, "a", stores, world=2, ranks=[0])  # rank 1's write failed
    again = [dataclasses.replace(s, disk_slot=s.disk_slot + 4) for s in stores]
    write_as(tmp_path, "a", again, world=2)
    b = scheduler(world=2, disk=tmp_path, instance_id="b", share_writers=2)
    assert b.num_new_matched_tokens(request("y", 65), 0) == (64, True)
    b.plan_load(request("y", 65), ([1, 2, 3, 4, 5],), 0, 64)
    (load,) = b.build_meta().loads
    assert sorted(c.other[0].slot for c in load.chunks) == sorted(s.disk_slot for s in again)
    assert all(c.other[0].slot == c.other[1].slot for c in load.chunks)
    b.close()
    a.close()


def test_a_worker_reads_another_engines_pages_and_never_writes_them(tmp_path):
    a, kv_a = worker(tmp_path, instance_id="a", share_writers=2)
    from kvtier.connector.common.messages import ChunkStore

    a.save(StepPlan(stores=[ChunkStore(b"k" * 16, (3, 4), host_slot=0, disk_slot=2)]))
    a.drain()
    from kvtier.shared.view import SharedView

    view = SharedView([str(tmp_path)], GEO.namespace("m", "", 1, 0), GEO.chunk_bytes, ("b",), 30)
    view.refresh()
    ref = view.ref(view.find(b"k" * 16))
    b, kv_b = worker(tmp_path, instance_id="b", share_writers=2)
    load = RequestLoad("r", (ChunkLoad(b"k" * 16, (8, 9), 0, host_slot=1, other=(ref,)),),
                       asynchronous=True)
    b.start_loads(StepPlan(loads=[load]))
    b.drain()
    assert b.finished() == {"r"} and b.take_invalid_blocks() == set()
    assert all(same(kv_b[i][8:10], kv_a[i][3:5]) for i in range(LAYERS))
    (slots,) = tmp_path.glob("*/writers/a/slots-0000.kvt")
    before = slots.read_bytes()
    data = bytearray(before)
    data[2 * (4096 + GEO.chunk_bytes) + 4096 + 100] ^= 0xFF  # damage a's copy
    slots.write_bytes(bytes(data))
    damaged = slots.read_bytes()
    for t in kv_b:
        t[8:10].zero_()
    b.start_loads(StepPlan(loads=[RequestLoad("s", load.chunks, asynchronous=True)]))
    b.drain()
    assert b.finished() == {"s"} and b.take_invalid_blocks() == {8, 9}
    assert all(torch.count_nonzero(kv_b[i][8:10]) == 0 for i in range(LAYERS))
    assert slots.read_bytes() == damaged and os.stat(slots).st_size == len(before)  # untouched
    for side in (a, b):
        side.close()
    view.close()


def test_without_an_instance_id_the_scheduler_side_finds_the_segment_its_workers_took(tmp_path):
    from kvtier.config.settings import load_config
    from kvtier.connector.common.engine_writer import engine_writers

    holder = subprocess.Popen(  # another engine of this host, on the first default writer id
        [sys.executable, "-c", HOLD_FIRST_ID, str(tmp_path)], cwd=ROOT,
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().startswith("ready")
        side, _ = worker(tmp_path, share_writers=2)  # takes the next id: <host>-1
        writer = side.disk.writer
        assert writer.endswith("-1")
        cfg = load_config({"disk_paths": [str(tmp_path)], "chunk_tokens": 2 * 16}, environ={})
        assert engine_writers(cfg, [GEO.namespace("m", "", 1, 0)]) == [writer]
        side.close()
    finally:
        holder.kill()
        holder.wait()


HOLD_FIRST_ID = """
import sys, time
from kvtier.disk.tier import DiskTier
from tests.helpers.worker_side import GEO
tier = DiskTier([sys.argv[1]], GEO.namespace("m", "", 1, 0), GEO.chunk_bytes,
                8 * (4096 + GEO.chunk_bytes), share_writers=2)
import os
print("ready", os.getpid(), flush=True)
time.sleep(600)
"""


def test_when_its_workers_segment_is_not_found_nothing_on_disk_is_taken_for_its_own(tmp_path):
    from kvtier.config.settings import load_config
    from kvtier.connector.common.engine_writer import engine_writers

    with another_engine_on_the_first_id(tmp_path):  # its index is not ours
        cfg = load_config({"disk_paths": [str(tmp_path)], "chunk_tokens": 2 * 16}, environ={})
        assert engine_writers(cfg, [GEO.namespace("m", "", 1, 0)]) == [None]


@contextlib.contextmanager
def another_engine_on_the_first_id(tmp_path):
    """Another engine (not a child of this process) holds <host>-0 on ``tmp_path``."""
    starter = subprocess.Popen(["sh", "-c", '"$0" -c "$1" "$2" &', sys.executable, HOLD_FIRST_ID,
                                str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    word, pid = starter.stdout.readline().split()
    starter.wait()
    try:
        assert word == "ready"
        yield
    finally:
        os.kill(int(pid), signal.SIGKILL)
        starter.stdout.close()


def test_when_its_workers_hold_no_segment_another_engines_segment_is_still_read(tmp_path):
    from kvtier.segment.names import writer_ids

    first = writer_ids(None)[0]
    a = scheduler(disk=tmp_path, instance_id=first, share_writers=2)
    write_as(tmp_path, first, store_all(a, request("x", 64)).stores)
    a.close()
    with another_engine_on_the_first_id(tmp_path):  # chunks and all
        # this engine's workers are not found (they hold no segment): its scheduler side
        # must not take the other engine's segment for its own and skip it
        b = scheduler(disk=tmp_path, share_writers=2)
        assert b.writers == [None] and b.recovered == 0
        assert [w.writer for w in b.others.writers()] == [first]
        assert b.num_new_matched_tokens(request("y", 65), 0) == (64, True)
        b.close()


def test_a_segment_opened_later_under_the_id_where_its_workers_stopped_is_read(tmp_path):
    """Its workers hold no segment (not found: another engine holds the first default id);
    another engine then opens the first id free, where the workers would have stopped:
    this engine reads its chunks, never skipping them as its own."""
    from kvtier.segment.names import writer_ids

    second = writer_ids(None)[1]
    with another_engine_on_the_first_id(tmp_path):
        b = scheduler(disk=tmp_path, share_writers=2, share_refresh="1h")
        assert b.writers == [None]
        a = scheduler(disk=tmp_path, instance_id=second, share_writers=2)
        write_as(tmp_path, second, store_all(a, request("x", 64)).stores)
        a.close()
        b.others.refresh()
        assert second in [w.writer for w in b.others.writers()]
        assert b.num_new_matched_tokens(request("y", 65), 0) == (64, True)
        b.close()


def test_a_segment_its_workers_open_after_it_started_is_its_own(tmp_path):
    """Its workers hold no segment when it starts; once one of them holds one, the view of
    the other engines passes over it as this engine's own."""
    with another_engine_on_the_first_id(tmp_path):
        b = scheduler(disk=tmp_path, share_writers=2, share_refresh="1h")
        assert b.writers == [None]
        side, _ = worker(tmp_path, share_writers=2)  # in this process: a worker of b's
        b.others.refresh()
        assert side.disk.writer not in [w.writer for w in b.others.writers()]
        assert len(b.others.writers()) == 1  # the other engine's
        side.close()
        b.close()
