"""A worker's counters: bytes loaded by where they were read from, and a since-start total
that stays the same size however many loads it has counted."""

from kvtier.connector.common.messages import ChunkLoad, RequestLoad
from kvtier.connector.worker.ledger import WorkerLedger
from kvtier.shared.reads import SlotRef


def chunk(i, **where):
    return ChunkLoad(bytes([i]) * 16, (i,), 0, host_slot=i, **where)


LOAD = RequestLoad("r", (chunk(0), chunk(1, disk_slot=3),
                         chunk(2, other=(SlotRef("w", 0, 5, b"k" * 16, 0, 64),)),
                         chunk(3, remote=True)))
COPIED = {"disk": 10, "shared": 20, "remote": 40}


def samples(ledger):
    return {(s.name, labels): value
            for s in ledger.metric_samples() for labels, value in s.values.items()}


def test_load_bytes_and_chunks_are_counted_by_where_they_were_read_from():
    ledger = WorkerLedger()
    with ledger.lock:
        ledger.record(lambda st: st.record_load(LOAD, COPIED, 100, 0.5, 0, 30))
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
            ledger.record(lambda st: st.record_load(LOAD, COPIED, 100, 0.25, 0))
    assert samples(ledger)[("load_seconds_total", ())] == 250.0
    assert ledger._totals.data["load_seconds"] == []  # nothing kept per load
    assert len(ledger.stats().data["load_seconds"]) == 1000  # the interval's, for percentiles
