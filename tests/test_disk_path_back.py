"""A disk path out of service since the start brings back what it holds when it comes back;
one that was in service before comes back empty (the store, the vLLM connector's worker and
scheduler sides)."""

import threading
import time
from collections import Counter

import pytest

from kvtier import KVStore
from kvtier.connector.common.messages import ChunkLoad, ChunkStore, RequestLoad, StepPlan, WorkerReport
from kvtier.disk.recovery import DiskRecovery
from kvtier.disk.stamps import WriteStamps
from kvtier.io import bounded_jobs
from kvtier.io.root_looks import under_way
from kvtier.segment import index_file
from kvtier.segment.index_file import read_disk_index
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
    side.build_meta()  # adopted at the next step
    assert adopted == [(a, 3), (b, 1)]  # newest first; c, d: not in one slot on both ranks
    assert disk.slot_of(e) == 0  # the copy stored meanwhile stays
    assert disk.free_slots == disk.num_slots - 3
    fill = [bytes([10 + n]) * 16 for n in range(disk.free_slots)]
    for key in fill:  # the tier full: the victims come in the order adoption left
        assert disk.reserve(key) is not None and disk.commit(key)
    victims = [disk.reserve(bytes([40 + n]) * 16).victim for n in range(3)]
    assert victims == [b, a, e]  # what a path back held goes before what the run stored


def test_a_path_out_again_before_every_rank_has_it_back_forgets_what_was_found(tmp_path):
    side, disk, adopted = two_path_scheduler(tmp_path, world=2)
    a = KEYS[0]
    side.worker_report(WorkerReport(paths_down=Counter({1: 2})))
    side.worker_report(WorkerReport(paths_up=Counter({1: 1}), paths_found={(1, 3, a): (1, 1)}))
    side.worker_report(WorkerReport(paths_down=Counter({1: 1})))  # out again on that rank
    side.worker_report(WorkerReport(paths_up=Counter({1: 1})))  # back: found nothing anew
    side.worker_report(WorkerReport(paths_up=Counter({1: 1}), paths_found={(1, 3, a): (1, 2)}))
    side.build_meta()  # (the path's slots back in service at the next step)
    assert adopted == [] and len(disk) == 0 and disk.free_slots == disk.num_slots


@pytest.mark.parametrize("world", [1, 2])
def test_a_path_back_empty_adopts_nothing(tmp_path, world):
    side, disk, adopted = two_path_scheduler(tmp_path, world)
    side.worker_report(WorkerReport(paths_down=Counter({0: world})))
    side.worker_report(WorkerReport(paths_up=Counter({0: world})))
    assert disk.free_slots == disk.num_slots // 2 and side.has_pending_push_work()
    side.build_meta()  # the path's slots back in service at the next step
    assert adopted == [] and disk.free_slots == disk.num_slots
    assert not side.has_pending_push_work()


# -- a read-back at start that does not end ------------------------------------------------


class StuckReadBack:
    """Once ``armed``, path 1's next read-back (the tier's at start, or an index read of the
    scheduler side's) blocks until released, as on a mount that stops answering after it
    answered (``hung`` says which did); a start waits 2 s for read-backs (a healthy one
    ends well within it on a loaded machine)."""

    def __init__(self) -> None:
        self.armed, self.hung, self.release = False, [], threading.Event()

    def hang_once(self, index: int) -> None:
        if self.armed and index == 1:
            self.armed = False
            self.hung.append(index)
            self.release.wait(30)


@pytest.fixture
def stuck(monkeypatch):
    stuck = StuckReadBack()
    real_tier, real_index = DiskRecovery._recover_path, index_file._index_entries

    def tier_read(self, index, directory, threads):
        stuck.hang_once(index)
        return real_tier(self, index, directory, threads)

    def index_read(root, namespace, layout, writer, index):
        stuck.hang_once(index)
        return real_index(root, namespace, layout, writer, index)

    monkeypatch.setattr(DiskRecovery, "_recover_path", tier_read)
    monkeypatch.setattr(index_file, "_index_entries", index_read)
    monkeypatch.setattr(bounded_jobs, "PATH_JOB_TIMES", 0)
    monkeypatch.setattr(bounded_jobs, "PATH_JOB_MIN_S", 2.0)
    yield stuck
    stuck.release.set()


def test_a_path_not_read_back_in_time_starts_out_and_brings_its_chunks_later(tmp_path, stuck):
    cfg, b = written_then_path_b_missing(tmp_path)
    (tmp_path / "away").rename(b)
    stuck.armed = True
    with KVStore(SMALL, {**cfg, "disk_retry": 1.0}) as store:  # before: the start held
        assert stuck.hung == [1]
        assert "not read back within 2 s" in store.stats().paths_down[str(b)]
        assert 0 < store.stats().recovered_chunks < 6
        until_back(store, seq(90_000, 1))  # read back again at the try (still stuck beside)
        assert store.stats().recovered_chunks == 6
        assert exact(store, TOKENS) == 6 * CHUNK


def test_the_scheduler_side_reads_no_index_that_does_not_end_in_time(tmp_path, stuck):
    cfg, b = written_then_path_b_missing(tmp_path)
    (tmp_path / "away").rename(b)
    with KVStore(SMALL, cfg) as store:
        tier = store.disk
        args = (tier.roots, tier.namespace, tier.layout, tier.writer)
    stuck.armed = True
    part = read_disk_index(*args, answer_timeout=10.0)
    assert stuck.hung == [1] and 0 < len(part) < 6
    assert all(slot % 2 == 0 for slot, _ in part.values())  # path 0's slots only
    assert read_disk_index(*args, answer_timeout=10.0) == part  # the hung read still held:
    assert stuck.hung == [1]  # path 1 is passed over, no second read left behind it
    stuck.release.set()
    wait_until(lambda: not under_way("kvtier-index-read"), "the held read to end")
    assert len(read_disk_index(*args, answer_timeout=10.0)) == 6


def test_a_read_back_at_a_try_holds_no_flush_and_is_given_up_when_it_hangs(tmp_path, stuck, caplog):
    import logging

    cfg, b = written_then_path_b_missing(tmp_path)
    probe = seq(90_000, 1)
    with KVStore(SMALL, cfg) as store, caplog.at_level(logging.INFO, logger="kvtier"):
        stuck.armed = True  # the try's read-back of path b stops answering
        (tmp_path / "away").rename(b)
        time.sleep(0.01)
        wait_until(lambda: store.lookup(probe) is not None and stuck.hung == [1],
                   "the try never began its read-back")
        assert not store.flush(timeout=10).timed_out  # before: its drain waited on the read-back
        until_back(store, probe)  # given up after 2 s, the path tried again: read back whole
        assert store.stats().recovered_chunks == 6
        assert any("not read back within 2 s" in r.getMessage() for r in caplog.records)
        assert exact(store, TOKENS) == 6 * CHUNK


def test_a_path_out_again_drops_what_was_found_on_it():
    """(so that a report holding the path back, what it held, and the path out again, in
    one step or in two merged, adopts nothing of it)"""
    from kvtier.connector.worker.ledger import WorkerLedger
    from kvtier.disk.recovery import RecoveredSlot
    from kvtier.io.format import Codec, SlotHeader

    a, b = KEYS[:2]
    found = [RecoveredSlot(3, SlotHeader(b"n" * 16, a, Codec.NONE, 1, 1, 1, 7, 1))]
    ledger = WorkerLedger()
    ledger.lane = type("Lane", (), {"newly_down": lambda self: {0: "out again"}})()
    ledger.path_back(0, found)
    assert ledger.pending.paths_found == {(0, 3, a): (1, 7)}
    ledger.note_down_paths()
    assert ledger.pending.paths_found == {} and ledger.pending.paths_down == Counter({0: 1})
    step = WorkerReport(paths_up=Counter({0: 1, 1: 1}),
                        paths_found={(0, 3, a): (1, 7), (1, 2, b): (1, 8)})
    later = WorkerReport(paths_down=Counter({0: 1}))
    assert step.merged(later).paths_found == {(1, 2, b): (1, 8)}


def test_a_path_back_with_many_chunks_is_adopted_a_few_a_step_newest_first(tmp_path, monkeypatch):
    """A path back with a hundred thousand chunks would hold one scheduler step for
    seconds: they are adopted ``ADOPT_PER_STEP`` a scheduler step (vLLM steps an idle
    engine while some are left), newest first, their slots out of service until then (a
    store meanwhile never lands on one); the order of eviction is the one adopting all at
    once leaves; a path out again drops the rest."""
    from kvtier.connector.scheduler import paths_back

    monkeypatch.setattr(paths_back, "ADOPT_PER_STEP", 2)
    side, disk, adopted = two_path_scheduler(tmp_path, world=1)
    a, b, c, d = KEYS[:4]
    side.worker_report(WorkerReport(paths_down=Counter({1: 1})))
    found = {(1, 1, a): (1, 10), (1, 3, b): (1, 30), (1, 5, c): (1, 50), (1, 7, d): (1, 70)}
    side.worker_report(WorkerReport(paths_up=Counter({1: 1}), paths_found=found))
    assert adopted == [] and side.has_pending_push_work()
    side.build_meta()
    assert adopted == [(d, 7), (c, 5)] and disk.free_slots == disk.num_slots - 4
    fill = [bytes([10 + n]) * 16 for n in range(disk.free_slots)]
    for key in fill:  # every free slot taken: none of those kept for b and a
        reservation = disk.reserve(key)
        assert reservation is not None and reservation.slot not in (1, 3) and disk.commit(key)
    side.build_meta()
    assert adopted[2:] == [(b, 3), (a, 1)] and side.has_pending_push_work()
    side.build_meta()  # then the path's other slots: none
    assert adopted[4:] == [] and not side.has_pending_push_work()
    victims = [disk.reserve(bytes([40 + n]) * 16).victim for n in range(4)]
    assert victims == [a, b, c, d]  # oldest first, before what the run stored
    (tmp_path / "again").mkdir()
    side, disk, adopted = two_path_scheduler(tmp_path / "again", world=1)
    side.worker_report(WorkerReport(paths_down=Counter({1: 1})))
    side.worker_report(WorkerReport(paths_up=Counter({1: 1}), paths_found=found))
    side.build_meta()
    side.worker_report(WorkerReport(paths_down=Counter({1: 1})))  # out again: the rest dropped
    side.worker_report(WorkerReport(paths_up=Counter({1: 1})))
    side.build_meta()
    assert adopted == [(d, 7), (c, 5)] and len(disk) == 0  # (what it held went with it)
    assert disk.free_slots == disk.num_slots


def test_a_key_discarded_while_its_old_copy_waits_to_be_adopted_is_not_adopted(tmp_path, monkeypatch):
    """A key stored again while its old copy on the path back waits to be adopted, then
    found wrong by a sampled check (discarded from every tier): the old copy is not adopted
    either (before a batched adoption, it was adopted first and went with the discard)."""
    from kvtier.connector.scheduler import paths_back

    monkeypatch.setattr(paths_back, "ADOPT_PER_STEP", 1)
    side, disk, adopted = two_path_scheduler(tmp_path, world=1)
    a, b = KEYS[:2]
    side.worker_report(WorkerReport(paths_down=Counter({1: 1})))
    found = {(1, 1, a): (1, 10), (1, 3, b): (1, 30)}
    side.worker_report(WorkerReport(paths_up=Counter({1: 1}), paths_found=found))
    assert disk.adopt(a, 0)  # stored again meanwhile, on path 0
    side.stack.discard(a)  # then found wrong: gone from every tier
    side.build_meta()
    side.build_meta()
    side.build_meta()  # the path's other slots
    assert adopted == [(b, 3)] and disk.slot_of(a) is None and disk.slot_of(b) == 3
    assert disk.free_slots == disk.num_slots - 1  # slot 1 back in service, empty


def test_a_discard_while_a_path_was_adopting_counts_for_no_later_path_back(tmp_path, monkeypatch):
    """A key discarded while path 1's chunks waited to be adopted, path 1 then out again:
    a later path back holding that key (written since) adopts it."""
    from kvtier.connector.scheduler import paths_back

    monkeypatch.setattr(paths_back, "ADOPT_PER_STEP", 1)
    side, disk, adopted = two_path_scheduler(tmp_path, world=1)
    a, b = KEYS[:2]
    side.worker_report(WorkerReport(paths_down=Counter({1: 1})))
    side.worker_report(WorkerReport(paths_up=Counter({1: 1}), paths_found={
        (1, 1, a): (1, 10), (1, 3, b): (1, 30)}))
    side.stack.discard(a)  # a copy found wrong while path 1 adopts
    side.worker_report(WorkerReport(paths_down=Counter({1: 1, 0: 1})))  # both out, none adopted
    side.worker_report(WorkerReport(paths_up=Counter({1: 1, 0: 1}), paths_found={(0, 2, a): (1, 50)}))
    for _ in range(3):
        side.build_meta()
    assert adopted == [(a, 2)] and disk.slot_of(a) == 2
