"""A read of another writer's copy that fails without proving the copy bad (an I/O error of a
network filesystem, a short read, a read not over in time) is a miss for that load only: the
copy stays, until several such reads in a row give it up. A read that proves it bad (its
header or checksum, the slot overwritten, its file gone) forgets it at once."""

import errno
import itertools
import os
from collections import Counter

import pytest

from kvtier import KVStore
from kvtier.connector.common.messages import ChunkLoad, ChunkStore, RequestLoad, StepPlan, WorkerReport
from kvtier.shared.misreads import MISSES_IN_A_ROW
from kvtier.shared.view import SharedView
from kvtier.tiers.base import TierName
from tests.helpers.disk_helpers import delayed_io, failing_io
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.scheduler_side import request, scheduler, store_all, write_as
from tests.helpers.shared import shared
from tests.helpers.store import exact, load, seq
from tests.helpers.worker_side import GEO, worker

SHARED = TierName.SHARED
FILLS = itertools.count()  # each fill of host memory with chunks not put before
TRANSIENT = [errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ESTALE, errno.EINTR]


def written_by_a(tmp_path, tokens):
    with KVStore(SMALL, shared(tmp_path, "a")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()


@pytest.mark.parametrize("err", TRANSIENT)
def test_a_read_failing_with_a_transient_error_keeps_the_copy(tmp_path, monkeypatch, err):
    tokens = seq(0, 4)
    written_by_a(tmp_path, tokens)
    with KVStore(SMALL, shared(tmp_path, "b", share_refresh="1h")) as b:
        assert b.lookup(tokens).chunks_by_tier == {SHARED: 4}
        with failing_io(monkeypatch, "/writers/a/", err, calls=("preadv",)):
            assert load(b, tokens)[0] == 0
        assert b.stats().shared_failures >= 1
        assert b.lookup(tokens).chunks_by_tier == {SHARED: 4}  # a miss this time only
        assert exact(b, tokens) == 4 * CHUNK


def test_a_short_read_keeps_the_copy(tmp_path, monkeypatch):
    tokens = seq(0, 2)
    written_by_a(tmp_path, tokens)
    real = os.preadv

    def short(fd, buffers, offset, *flags):  # the file seems to end midway (NFS)
        got = real(fd, buffers, offset, *flags)
        return min(got, 100) if "/writers/a/" in os.readlink(f"/proc/self/fd/{fd}") else got

    with KVStore(SMALL, shared(tmp_path, "b", share_refresh="1h")) as b:
        monkeypatch.setattr(os, "preadv", short)
        assert load(b, tokens)[0] == 0
        monkeypatch.undo()
        assert b.lookup(tokens).chunks_by_tier == {SHARED: 2}
        assert exact(b, tokens) == 2 * CHUNK


def test_failing_reads_in_a_row_give_the_copy_up_and_a_good_read_ends_the_row(tmp_path,
                                                                            monkeypatch):
    tokens = seq(0, 2)
    written_by_a(tmp_path, tokens)
    with KVStore(SMALL, shared(tmp_path, "b", share_refresh="1h")) as b:
        for _ in range(2):  # failures, a good read, failures: never that many in a row
            with failing_io(monkeypatch, "/writers/a/", calls=("preadv",)):
                for _ in range(MISSES_IN_A_ROW - 1):
                    assert load(b, tokens)[0] == 0
            assert b.lookup(tokens).tokens == 2 * CHUNK
            assert exact(b, tokens) == 2 * CHUNK
            out_of_memory(b, tokens)
        with failing_io(monkeypatch, "/writers/a/", calls=("preadv",)):
            for _ in range(MISSES_IN_A_ROW):
                assert load(b, tokens)[0] == 0
        assert b.lookup(tokens).tokens == 0  # given up: a broken path costs no more reads


def out_of_memory(store, theirs):
    """Fill ``store``'s host memory (4 chunks) with chunks of its own: another writer's
    chunks there (``theirs``) are let go, to be read from that writer's segment again."""
    mine = seq(900_000 + 10_000 * next(FILLS), 4)
    store.put(mine, make_kv(mine))
    assert store.lookup(theirs).chunks_by_tier == {SHARED: len(theirs) // CHUNK}


def test_reads_not_over_in_time_count_as_failures_that_prove_nothing(tmp_path, monkeypatch):
    tokens = seq(0, 1)
    written_by_a(tmp_path, tokens)
    with KVStore(SMALL, shared(tmp_path, "b", share_refresh="1h", load_timeout="100ms")) as b:
        for n in range(MISSES_IN_A_ROW):
            assert b.lookup(tokens).tokens == CHUNK  # kept: a miss for each load till then
            hung = delayed_io(monkeypatch, "preadv")  # a's path answers nothing
            assert load(b, tokens)[0] == 0
            assert b.stats().load_timeouts == n + 1
            hung.set()  # its read ends late (its host slot free again)
        assert b.lookup(tokens).tokens == 0


def test_a_copy_whose_file_is_gone_is_forgotten_at_once(tmp_path):
    tokens = seq(0, 2)
    written_by_a(tmp_path, tokens)
    with KVStore(SMALL, shared(tmp_path, "b", share_refresh="1h")) as b:
        assert b.lookup(tokens).chunks_by_tier == {SHARED: 2}
        (slots,) = tmp_path.glob("*/writers/a/slots-0000.kvt")
        slots.unlink()
        assert load(b, tokens)[0] == 0
        assert b.lookup(tokens).tokens == 0


def test_a_descriptor_that_failed_is_opened_again_at_the_next_read(tmp_path, monkeypatch):
    """An NFS handle gone stale (ESTALE) stays stale: the file is opened again."""
    tokens = seq(0, 1)
    written_by_a(tmp_path, tokens)
    real, opened = os.open, []

    def counting(path, *args, **kwargs):
        opened.append(path)
        return real(path, *args, **kwargs)

    with KVStore(SMALL, shared(tmp_path, "b", share_refresh="1h")) as b:
        monkeypatch.setattr(os, "open", counting)
        assert exact(b, tokens) == CHUNK
        assert opened.count("slots-0000.kvt") == 1
        out_of_memory(b, tokens)
        with failing_io(monkeypatch, "/writers/a/", errno.ESTALE, calls=("preadv",)):
            assert load(b, tokens)[0] == 0
        before = opened.count("slots-0000.kvt")
        assert exact(b, tokens) == CHUNK
        assert opened.count("slots-0000.kvt") == before + 1  # not the descriptor that failed


def test_in_vllm_a_copy_a_rank_failed_to_read_stays_unless_proven_bad(tmp_path):
    a = scheduler(disk=tmp_path, instance_id="a", share_writers=2)
    write_as(tmp_path, "a", store_all(a, request("x", 64)).stores)
    b = scheduler(disk=tmp_path, instance_id="b", share_writers=2)
    failed = None
    for n in range(MISSES_IN_A_ROW):
        name = f"y{n}"
        assert b.num_new_matched_tokens(request(name, 65), 0)[0] == 64
        b.plan_load(request(name, 65), ([1, 2, 3, 4, 5],), 0, 64)
        (load_plan,) = b.build_meta().loads
        failed = load_plan.chunks[-1].key  # the last chunk: read from a's segment each time
        assert load_plan.chunks[-1].other is not None
        assert b.others.find(failed) is not None  # still there: nothing proven
        b.worker_report(WorkerReport(load_failed={name: {failed}}, loads_done=Counter({name: 1})))
    assert b.others.find(failed) is None  # that many failed reads in a row: given up
    assert b.counters["load_failed_chunks"] == MISSES_IN_A_ROW
    b.close()
    a.close()


def test_in_vllm_a_read_that_proves_the_copy_bad_forgets_it_at_once(tmp_path):
    a = scheduler(disk=tmp_path, instance_id="a", share_writers=2)
    write_as(tmp_path, "a", store_all(a, request("x", 64)).stores)
    b = scheduler(disk=tmp_path, instance_id="b", share_writers=2)
    b.num_new_matched_tokens(request("y", 65), 0)
    b.plan_load(request("y", 65), ([1, 2, 3, 4, 5],), 0, 64)
    (load_plan,) = b.build_meta().loads
    bad = load_plan.chunks[1].key
    b.worker_report(WorkerReport(load_failed={"y": {bad}}, other_bad={bad},
                                 loads_done=Counter({"y": 1})))
    assert b.others.find(bad) is None
    b.close()
    a.close()


def test_a_worker_says_which_failed_reads_proved_another_engines_copy_bad(tmp_path, monkeypatch):
    key = b"k" * 16
    a, _ = worker(tmp_path, instance_id="a", share_writers=2)
    a.save(StepPlan(stores=[ChunkStore(key, (3, 4), host_slot=0, disk_slot=2)]))
    a.drain()
    view = SharedView([str(tmp_path)], GEO.namespace("m", "", 1, 0), GEO.chunk_bytes, ("b",), 30)
    view.refresh()
    chunks = (ChunkLoad(key, (8, 9), 0, host_slot=1, other=(view.ref(view.find(key)),)),)
    b, _ = worker(tmp_path, instance_id="b", share_writers=2)
    with failing_io(monkeypatch, "/writers/a/", calls=("preadv",)):
        b.start_loads(StepPlan(loads=[RequestLoad("r", chunks, asynchronous=True)]))
        b.drain()
        assert b.finished() == {"r"}
    report = b.report()
    assert report.load_failed == {"r": {key}} and report.other_bad == set()
    (slots,) = tmp_path.glob("*/writers/a/slots-0000.kvt")
    data = bytearray(slots.read_bytes())
    data[2 * (4096 + GEO.chunk_bytes) + 4096 + 100] ^= 0xFF  # damage a's copy
    slots.write_bytes(bytes(data))
    b.start_loads(StepPlan(loads=[RequestLoad("s", chunks, asynchronous=True)]))
    b.drain()
    assert b.finished() == {"s"}
    report = b.report()
    assert report.load_failed == {"s": {key}} and report.other_bad == {key}
    for side in (a, b):
        side.close()
    view.close()
