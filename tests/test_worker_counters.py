"""A worker's counters: bytes loaded by where they were read from, and a since-start total
that stays the same size however many loads it has counted."""

from kvtier.connector.worker.ledger import WorkerLedger

CHUNKS = {"host": 1, "disk": 1, "shared": 1, "remote": 1}  # copied, by where from
COPIED = {"disk": 10, "shared": 20, "remote": 40}


def samples(ledger):
    return {(s.name, labels): value
            for s in ledger.metric_samples() for labels, value in s.values.items()}


def test_load_bytes_and_chunks_are_counted_by_where_they_were_read_from():
    ledger = WorkerLedger()
    with ledger.lock:
        ledger.record(lambda st: st.record_load(CHUNKS, COPIED, 100, 0.5, 0, 30))
    got = samples(ledger)
    assert {tier: got[("load_bytes_total", (("tier", tier),))]
            for tier in ("host", "disk", "shared", "remote")} == {
        "host": 30, "disk": 10, "shared": 20, "remote": 40}
    assert got[("worker_chunks_from_shared_total", ())] == 1
    assert got[("worker_chunks_from_remote_total", ())] == 1
    stats = ledger.stats().reduce()
    assert (stats["chunks_from_host"], stats["chunks_from_disk"], stats["chunks_from_shared"],
            stats["chunks_from_remote"]) == (1, 1, 1, 1)
    assert (stats["load_bytes_disk"], stats["load_bytes_shared"],
            stats["load_bytes_remote"]) == (10, 20, 40)


def test_the_since_start_load_time_is_a_sum_not_one_entry_per_load():
    ledger = WorkerLedger()
    for _ in range(1000):
        with ledger.lock:
            ledger.record(lambda st: st.record_load(CHUNKS, COPIED, 100, 0.25, 0))
    assert samples(ledger)[("load_seconds_total", ())] == 250.0
    assert ledger._totals.data["load_seconds"] == []  # nothing kept per load
    assert len(ledger.stats().data["load_seconds"]) == 1000  # the interval's, for percentiles


def test_chunks_a_load_did_not_copy_are_not_counted_as_loaded(tmp_path):
    """Chunks the scheduler cut (no host slot) and those after a failed read are
    recomputed, not loaded: they were counted as loaded from host memory (a review)."""
    from kvtier.connector.common.messages import ChunkLoad, ChunkStore, RequestLoad, StepPlan
    from tests.helpers.worker_side import worker

    side, _ = worker(tmp_path)
    try:
        side.save(StepPlan(stores=[ChunkStore(b"h" * 16, (1, 2), host_slot=0)]))
        side.drain()
        side.stats()
        cut = RequestLoad("cut", tuple(ChunkLoad(bytes([65 + i]) * 16, (3 + 2 * i, 4 + 2 * i), 0,
                                                 None) for i in range(3)))
        bad = RequestLoad("bad", (ChunkLoad(b"x" * 16, (9, 10), 0, host_slot=3, disk_slot=7),
                                  ChunkLoad(b"h" * 16, (11, 12), 0, host_slot=0)), asynchronous=True)
        good = RequestLoad("good", (ChunkLoad(b"h" * 16, (13, 14), 0, host_slot=0),))
        side.start_loads(StepPlan(loads=[cut, bad, good]))
        side.drain()
        assert side.finished() == {"bad"}
        stats = side.stats().reduce()
        assert (stats["loads"], stats["chunks_from_host"], stats["chunks_from_disk"],
                stats["load_failures"]) == (3, 1, 0, 1)
    finally:
        side.close()
