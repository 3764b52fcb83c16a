"""A disk path out of service since the start brings back what it holds when it comes back;
one that was in service before comes back empty (the store, the vLLM connector's worker and
scheduler sides)."""

import time
from collections import Counter

import pytest

from kvtier import KVStore
from kvtier.connector.common.messages import ChunkLoad, ChunkStore, RequestLoad, StepPlan, WorkerReport
from kvtier.disk.stamps import WriteStamps
from kvtier.tiers.base import TierName
from tests.helpers.disk_helpers import failing_io, wait_until
from tests.helpers.kv import CHUNK, SMALL, index_of, make_kv
from tests.helpers.scheduler_side import GEO, scheduler
from tests.helpers.store import config, exact, seq
from tests.helpers.worker_side import LAYERS, same, worker

DISK = TierName.DISK


TOKENS = seq(0, 6)


def written_then_path_b_missing(tmp_path) -> tuple[dict, object]:
    """A store's config over two paths (``a``, ``b``) on which a first store wrote TOKENS'
    chunks, path ``b`` then moved away: (the config, its path ``b``)."""
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        root.mkdir(exist_ok=True)
    cfg = {**config(tmp_path, host_chunks=2), "disk_paths": [str(r) for r in roots]}
    with KVStore(SMALL, cfg) as first:
        first.put(TOKENS, make_kv(TOKENS))
        assert first.flush()
    roots[1].rename(tmp_path / "away")
    return {**cfg, "disk_retry": 0.001}, roots[1]


def until_back(store, probe) -> None:
    """Ask the store (each call tries the paths due) until a path came back."""
    def back() -> bool:
        store.lookup(probe)
        return store.stats().paths_back >= 1
    wait_until(back, "the path never came back")


def test_a_path_missing_at_start_brings_its_chunks_when_it_comes_back(tmp_path):
    cfg, b = written_then_path_b_missing(tmp_path)
    tokens = TOKENS
    with KVStore(SMALL, cfg) as store:
        assert "does not exist" in store.stats().paths_down[str(b)]
        at_start = store.stats().recovered_chunks
        assert 0 < at_start < 6  # the chunks on the other path only
        assert exact(store, tokens) < 6 * CHUNK
        (tmp_path / "away").rename(b)
        time.sleep(0.01)  # past disk_retry
        until_back(store, seq(90_000, 1))
        stats = store.stats()
        assert stats.recovered_chunks == 6 and not stats.paths_down
        before = stats.chunks_loaded.get(DISK, 0)
        assert exact(store, tokens) == 6 * CHUNK  # every byte checked
        assert store.stats().chunks_loaded[DISK] - before >= 6 - at_start
        assert store.stats().corruptions == 0


def test_a_key_stored_while_its_path_was_out_keeps_that_copy(tmp_path):
    cfg, b = written_then_path_b_missing(tmp_path)
    tokens = TOKENS
    with KVStore(SMALL, cfg) as store:
        store.put(tokens, make_kv(tokens))  # those on the missing path go to the other
        assert store.flush()
        disk = index_of(store, DISK)
        slots, at_start = dict(disk.visible()), store.stats().recovered_chunks
        assert len(slots) == 6
        (tmp_path / "away").rename(b)
        time.sleep(0.01)
        until_back(store, seq(90_000, 1))
        assert {key: disk.slot_of(key) for key in slots} == slots  # none moved to path b
        assert exact(store, tokens) == 6 * CHUNK
        assert store.stats().recovered_chunks == at_start  # nothing of b's adopted


def test_a_store_that_gets_the_disk_once_the_first_is_gone_serves_its_chunks(tmp_path):
    tokens = seq(0, 3)
    first = KVStore(SMALL, config(tmp_path, host_chunks=2, instance_id="node-a"))
    first.put(tokens, make_kv(tokens))
    assert first.flush()
    second = KVStore(SMALL, config(tmp_path, host_chunks=2, disk_retry=0.001, instance_id="node-a"))
    try:
        assert "in use" in second.stats().paths_down[str(tmp_path)]
        assert second.stats().recovered_chunks == 0
        first.close()
        time.sleep(0.01)
        until_back(second, seq(90_000, 1))
        assert second.stats().recovered_chunks == 3
        assert exact(second, tokens) == 3 * CHUNK
    finally:
        first.close()
        second.close()


def test_a_path_back_after_a_fault_comes_back_empty(tmp_path, monkeypatch):
    import errno

    tokens = seq(0, 4)
    with KVStore(SMALL, config(tmp_path, host_chunks=2, disk_retry=0.001)) as store:
        store.put(tokens, make_kv(tokens))
        assert store.flush()
        disk = index_of(store, DISK)
        assert len(disk) == 4
        with failing_io(monkeypatch, "slots-", err=errno.EROFS, calls=("pwritev",)):
            store.put(seq(50_000, 2), make_kv(seq(50_000, 2)))
            store.flush()
        assert str(tmp_path) in store.stats().paths_down and len(disk) == 0
        time.sleep(0.01)
        until_back(store, seq(90_000, 1))
        # what it held is not vouched for (a write, a sync may have failed unseen): not used
        assert len(disk) == 0 and store.stats().recovered_chunks == 0


def test_later_stamps_go_past_a_generation_recovered_and_keep_those_given():
    stamps = WriteStamps()
    stamps.reserve(3)
    given = stamps.of(3)
    stamps.past(given[0] + 10**15)
    assert stamps.of(3) == given  # kept
    assert stamps.of(4)[0] > given[0] + 10**15
    stamps.past(0)  # never backwards
    assert stamps.of(5)[0] > stamps.of(4)[0]


# -- the vLLM connector ---------------------------------------------------------------------


def test_a_worker_reports_the_chunks_of_a_path_back_after_being_out_since_its_start(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    first, kv = worker(tmp_path, disk_paths=[str(root)])
    original = [t.clone() for t in kv]
    first.save(StepPlan(stores=[ChunkStore(b"k" * 16, (3, 4), host_slot=0, disk_slot=5),
                                ChunkStore(b"j" * 16, (6, 7), host_slot=1, disk_slot=6)]))
    first.drain()
    assert first.report().disk_written == Counter({b"k" * 16: 1, b"j" * 16: 1})
    first.close()
    root.rename(tmp_path / "away")
    side, kv = worker(tmp_path, disk_paths=[str(root)], disk_retry=0.001)
    assert side.report().paths_down == Counter({0: 1})
    (tmp_path / "away").rename(root)
    time.sleep(0.01)
    reports: list[WorkerReport] = []

    def back() -> bool:
        side.save(StepPlan())  # each step tries a path that is due
        side.drain()
        reports.append(side.report() or WorkerReport())
        return any(r.paths_up for r in reports)
    wait_until(back, "the path never came back")
    (report,) = [r for r in reports if r.paths_up]
    assert report.paths_up == Counter({0: 1})
    assert {where: ranks for where, (ranks, _) in report.paths_found.items()} == {
        (0, 5, b"k" * 16): 1, (0, 6, b"j" * 16): 1}
    load = RequestLoad("r", (ChunkLoad(b"k" * 16, (8, 9), 0, host_slot=2, disk_slot=5),),
                       asynchronous=True)
    side.start_loads(StepPlan(loads=[load]))
    side.drain()
    assert side.finished() == {"r"} and side.take_invalid_blocks() == set()
    assert all(same(kv[i][8:10], original[i][3:5]) for i in range(LAYERS))
    side.close()


def test_two_ranks_findings_add_up_with_the_oldest_generation():
    one = WorkerReport(paths_found={(0, 3, b"a" * 16): (1, 30), (0, 1, b"b" * 16): (1, 10)})
    two = WorkerReport(paths_found={(0, 3, b"a" * 16): (1, 20), (0, 2, b"b" * 16): (1, 11)})
    assert one.merged(two).paths_found == {(0, 3, b"a" * 16): (2, 20), (0, 1, b"b" * 16): (1, 10),
                                           (0, 2, b"b" * 16): (1, 11)}
    assert not WorkerReport(paths_found={(0, 1, b"b" * 16): (1, 1)}).is_empty()


def two_path_scheduler(tmp_path, world: int):
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        root.mkdir()
    side = scheduler(world=world, disk_paths=[str(r) for r in roots],
                     disk_capacity=8 * (4096 + GEO.chunk_bytes))
    adopted: list = []
    assert side._outcomes.paths is not None
    side._outcomes.paths.on_adopted = adopted.extend
    return side, side.stack.indexes[DISK], adopted


KEYS = [bytes([i]) * 16 for i in range(5)]


def test_the_scheduler_adopts_what_every_rank_found_in_the_same_slot_oldest_first(tmp_path):
    side, disk, adopted = two_path_scheduler(tmp_path, world=2)
    a, b, c, d, e = KEYS
    assert disk.adopt(e, 0)  # path 0 (even slots): stored there meanwhile
    side.worker_report(WorkerReport(paths_down=Counter({1: 2})))
    one = {(1, 3, a): (1, 30), (1, 1, b): (1, 10), (1, 5, c): (1, 50), (1, 7, e): (1, 5)}
    two = {(1, 3, a): (1, 31), (1, 1, b): (1, 11), (1, 7, c): (1, 60), (1, 5, d): (1, 70),
           (1, 7, e): (1, 6)}
    side.worker_report(WorkerReport(paths_up=Counter({1: 1}), paths_found=one))
    assert adopted == [] and len(disk) == 1 and disk.free_slots == disk.num_slots // 2 - 1
    side.worker_report(WorkerReport(paths_up=Counter({1: 1}), paths_found=two))
    assert adopted == [(b, 1), (a, 3)]  # c, d: not in the same slot on both ranks
    assert disk.slot_of(e) == 0  # the copy stored meanwhile stays
    assert disk.free_slots == disk.num_slots - 3


def test_a_path_out_again_before_every_rank_has_it_back_forgets_what_was_found(tmp_path):
    side, disk, adopted = two_path_scheduler(tmp_path, world=2)
    a = KEYS[0]
    side.worker_report(WorkerReport(paths_down=Counter({1: 2})))
    side.worker_report(WorkerReport(paths_up=Counter({1: 1}), paths_found={(1, 3, a): (1, 1)}))
    side.worker_report(WorkerReport(paths_down=Counter({1: 1})))  # out again on that rank
    side.worker_report(WorkerReport(paths_up=Counter({1: 1})))  # back: found nothing anew
    side.worker_report(WorkerReport(paths_up=Counter({1: 1}), paths_found={(1, 3, a): (1, 2)}))
    assert adopted == [] and len(disk) == 0 and disk.free_slots == disk.num_slots


@pytest.mark.parametrize("world", [1, 2])
def test_a_path_back_empty_adopts_nothing(tmp_path, world):
    side, disk, adopted = two_path_scheduler(tmp_path, world)
    side.worker_report(WorkerReport(paths_down=Counter({0: world})))
    side.worker_report(WorkerReport(paths_up=Counter({0: world})))
    assert adopted == [] and disk.free_slots == disk.num_slots
