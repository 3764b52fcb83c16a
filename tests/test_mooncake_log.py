"""The values of Mooncake Store's log of token records (``kvtier/remote/mooncake_log.py``),
without a store: batches split within their bounds, parsed back whole, and any other bytes
(cut, grown, another seq's, random) read as no batch, never raising; cursors and head hints
the same. A reader against a fake client: a batch gone or too large to be one passed over,
any other failure ending the read before it. The log against a real store:
tests/mooncake_inner_records.py."""

import ctypes
import random

import numpy as np

from kvtier.keys import ChunkKey
from kvtier.remote import mooncake_log
from kvtier.remote.mooncake_client import CODE_NAMES, INVALID_PARAMS, NOT_FOUND, TRANSFER_FAIL
from kvtier.remote.mooncake_log import (
    BATCH_BYTES,
    ENTRIES,
    NOT_READY,
    TOO_LARGE,
    RecordLog,
    pack_batch,
    pack_head,
    parse_cursor,
    split,
    unpack_batch,
    unpack_head,
)


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def test_appends_split_into_batches_within_their_bounds_in_order():
    items = [(key(i), bytes([i % 256]) * 1100) for i in range(300)]
    batches, dropped = split(items)
    assert dropped == 0 and [e for b in batches for e in b] == [(bytes(k), r) for k, r in items]
    assert all(len(b) <= ENTRIES and len(pack_batch(1, b)) <= BATCH_BYTES for b in batches)
    big = [(key(1), b"x" * 5000)] * 40  # 40 records of 5 KiB: by bytes, not count
    batches, _ = split(big)
    assert len(batches) == 2 and all(len(pack_batch(1, b)) <= BATCH_BYTES for b in batches)
    assert split([(key(1), b"x" * BATCH_BYTES), (key(2), b"ok")]) == ([[(bytes(key(2)), b"ok")]], 1)


def test_a_batch_reads_back_only_whole_and_under_its_own_seq():
    entries = [(bytes(key(i)), b"r" * i) for i in range(10)]
    value = pack_batch(7, entries)
    assert unpack_batch(value, 7) == entries
    assert unpack_batch(pack_batch(7, []), 7) == []
    assert unpack_batch(value, 8) is None  # another seq's batch
    for cut in range(len(value)):
        assert unpack_batch(value[:cut], 7) is None
    assert unpack_batch(value + b"\0", 7) is None
    assert unpack_batch(b"KVRL" + b"\xff" * 100, 7) is None
    too_many = pack_batch(7, [(b"k", b"r")] * (ENTRIES + 1))
    assert unpack_batch(too_many, 7) is None


def test_random_and_damaged_bytes_never_raise():
    rng = random.Random(5)
    value = pack_batch(3, [(bytes(key(1)), b"abc"), (bytes(key(2)), b"defg")])
    for _ in range(3000):
        damaged = bytearray(value)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        answer = unpack_batch(bytes(damaged), 3)
        assert answer is None or all(isinstance(k, bytes) and isinstance(r, bytes) for k, r in answer)
        noise = rng.randbytes(rng.randrange(80))
        assert unpack_batch(noise, 3) is None
        assert isinstance(unpack_head(noise), int)
        assert parse_cursor(noise) is None or parse_cursor(noise)[0] > 0


def test_head_hints_and_cursors_are_parsed_with_bounds():
    assert unpack_head(pack_head(12)) == 12
    assert unpack_head(pack_head(12)[:-1]) == 0 and unpack_head(-704) == 0
    assert unpack_head(b"KVRX" + pack_head(12)[4:]) == 0
    assert unpack_head(pack_head(10**18 - 1)) == 10**18 - 1 and unpack_head(pack_head(10**18)) == 0
    assert parse_cursor(b"%d.3" % (10**18 - 1)) == (10**18 - 1, 3)
    assert parse_cursor(b"0") is None and parse_cursor(b"") is None
    assert parse_cursor(b"17") == (17, None) and parse_cursor(b"17.5") == (17, 5)
    for junk in (b"-1", b"1.2.3", b"9" * 40, b"1-0", b" 1", b"1.", "17"):
        assert parse_cursor(junk) is None  # type: ignore[arg-type]


class FakeStore:
    """Mooncake's client as the log uses it: ``values`` by name, ``codes`` a get of a name
    answers instead (a failure), ``once`` the codes its next gets answer, ``sizes`` the size
    ``get_size`` reports instead; a put never replaces a value and answers 0 either way,
    after ``rival`` (other writers) had its turn; ``calls`` the round trips made."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.codes: dict[str, int] = {}
        self.once: dict[str, list[int]] = {}
        self.sizes: dict[str, int] = {}
        self.rival = lambda names: None
        self.calls: list[str] = []

    def batch_get_into(self, names, addresses, sizes):
        self.calls.append("get")
        answers = []
        for name, address, size in zip(names, addresses, sizes, strict=True):
            value = self.values.get(name)
            if self.once.get(name):
                answers.append(self.once[name].pop(0))
            elif name in self.codes or value is None:
                answers.append(self.codes.get(name, NOT_FOUND))
            elif len(value) > size:
                answers.append(INVALID_PARAMS)  # Mooncake's answer for a buffer too small
            else:
                ctypes.memmove(address, value, len(value))
                answers.append(len(value))
        return answers

    def get_size(self, name):
        value = self.values.get(name)
        return self.sizes.get(name, NOT_FOUND if value is None else len(value))

    def batch_put_from(self, names, addresses, sizes, upsert=False):
        self.calls.append("upsert" if upsert else "put")
        if not upsert:
            self.rival(names)
        for name, address, size in zip(names, addresses, sizes, strict=True):
            if upsert or name not in self.values:
                self.values[name] = ctypes.string_at(address, size)
        return [0] * len(names)

    def batch_upsert_from(self, names, addresses, sizes):
        return self.batch_put_from(names, addresses, sizes, upsert=True)

    def batch_is_exist(self, names):
        self.calls.append("exist")
        return [int(name in self.values) for name in names]

    def batch_remove(self, names, force):
        self.calls.append("remove")
        return [0 if self.values.pop(name, None) is not None else NOT_FOUND for name in names]


def record_log(store: FakeStore, batches: dict[int, list], head: int) -> RecordLog:
    for seq, entries in batches.items():
        store.values[f"log:{seq}"] = pack_batch(seq, entries)
    store.values["log:head"] = pack_head(head)
    return RecordLog("log", lambda what, call, codes_of: call(store), lambda c, n: np.zeros(n, np.uint8))


def entries(seq: int) -> list:
    return [(bytes(key(seq)), b"record %d" % seq)]


def test_a_read_ends_at_a_batch_the_store_failed_to_answer_and_reads_it_next_time():
    """At or below the head only a batch gone (removed, evicted) is passed over: a transfer
    that failed, or INVALID_PARAMS for a batch that is not there, ends the read with the
    cursor before it, and the batch is read once the store answers it."""
    store = FakeStore()
    log = record_log(store, {1: entries(1), 3: entries(3), 4: entries(4)}, head=4)  # 2: evicted
    store.codes["log:3"] = TRANSFER_FAIL
    assert log.read(b"0", 10) == (b"2", entries(1))
    store.codes["log:3"] = -1  # INTERNAL_ERROR
    assert log.read(b"2", 10) == (b"2", [])
    del store.codes["log:3"]
    assert log.read(b"2", 10) == (b"4", entries(3) + entries(4))
    store.codes["log:5"] = INVALID_PARAMS  # past the head, for a batch not put yet
    assert log.read(b"4", 10) == (b"4", [])
    store.codes["log:5"] = INVALID_PARAMS
    store.sizes["log:5"] = 100  # a size a batch can have: not too large, so read again
    assert log.read(b"4", 10) == (b"4", [])
    del store.codes["log:5"], store.sizes["log:5"]
    record_log(store, {5: entries(5)}, head=5)
    assert log.read(b"4", 10) == (b"5", entries(5))


def test_a_read_passes_over_values_too_large_to_be_batches_and_batches_gone():
    store = FakeStore()
    log = record_log(store, {1: entries(1), 4: entries(4)}, head=4)
    store.values["log:2"] = b"x" * (BATCH_BYTES + 1)  # INVALID_PARAMS, and its size says why
    store.codes["log:3"] = TRANSFER_FAIL
    store.sizes["log:3"] = 2 * BATCH_BYTES
    assert log.read(b"0", 10) == (b"4", entries(1) + entries(4))
    store.values["log:6"] = b"x" * (BATCH_BYTES + 1)  # past the head: no batch either
    record_log(store, {7: entries(7)}, head=4)
    assert log.read(b"4", 10) == (b"4", [])  # 5 missing past the head: the log ends there
    store.values["log:5"] = b""  # a value of no bytes: no batch
    assert log.read(b"4", 10) == (b"7", entries(7))


def test_which_codes_end_the_log_for_now():
    log = record_log(FakeStore(), {}, head=0)
    for code in (NOT_FOUND, -710, -712):
        assert not log._ends(code, 5, head=5) and log._ends(code, 6, head=5)
    for code in (TRANSFER_FAIL, INVALID_PARAMS, -1, -10, -900, -901, -1010):
        assert log._ends(code, 5, head=5) and log._ends(code, 6, head=5)
    assert not log._ends(TOO_LARGE, 5, head=5) and not log._ends(TOO_LARGE, 6, head=5)
    assert log._ends(NOT_READY, 5, head=5) and log._ends(NOT_READY, 6, head=5)
    assert TOO_LARGE not in CODE_NAMES and min(CODE_NAMES) > TOO_LARGE


def test_a_writer_that_lost_its_claim_catches_up_however_far_the_head_lags():
    """Other writers took seqs 4 to 40 and the head still says 3 (their upserts of it failed,
    or are still under way): a lost claim asks which seqs after it the store holds, in one
    round trip, and puts past the last one held; the seqs left free below it stay free (a
    reader may have passed them). Rivals that take the seq it aims at each time cost it a
    try each, not a climb."""
    store = FakeStore()
    log = record_log(store, {seq: entries(seq) for seq in (*range(1, 17), *range(18, 41))}, head=3)
    assert log.append([(key(100), b"mine")])
    assert unpack_batch(store.values["log:41"], 41) == [(bytes(key(100)), b"mine")]
    assert "log:17" not in store.values and unpack_head(store.values["log:head"]) == 41
    assert store.calls.count("put") == 2 + 37 // mooncake_log.PROBE, store.calls  # 4, 21, 38, 41
    taken = iter(range(42, 45))  # a rival takes the seq aimed at, three times

    def rival(names):
        seq = next(taken, None)
        if seq is not None:
            store.values[f"log:{seq}"] = pack_batch(seq, entries(seq))
    store.rival = rival
    assert log.append([(key(101), b"next")])
    assert unpack_batch(store.values["log:45"], 45) == [(bytes(key(101)), b"next")]


def test_a_head_being_upserted_is_read_again_not_taken_for_no_head():
    """A get of the head while another writer upserts it answers REPLICA_IS_NOT_READY: read
    again, the append goes after the head, not to seq 1 (removed long ago: no reader would
    look there). Unknown still, a writer goes on from its own last seq while the store
    keeps that batch, and appends nothing (a hint lost) once it is gone: the log moved on
    far past it, and a batch put there would be behind every reader, the head taken back."""
    store = FakeStore()
    log = record_log(store, {seq: entries(seq) for seq in range(2000, 2004)}, head=2003)
    store.once["log:head"] = [NOT_READY, NOT_READY]
    assert log.append([(key(1), b"one")])
    assert "log:1" not in store.values and unpack_batch(store.values["log:2004"], 2004) is not None
    for seq in range(1, 2005):  # the fleet writes on, and the old batches go
        store.values.pop(f"log:{seq}", None)
    record_log(store, {seq: entries(seq) for seq in range(2990, 3001)}, head=3000)
    store.once["log:head"] = [NOT_READY] * mooncake_log.HEAD_TRIES
    before = dict(store.values)
    assert not log.append([(key(2), b"two")])
    assert store.values == before
    assert log.append([(key(3), b"three")])  # the head read: after it
    assert unpack_batch(store.values["log:3001"], 3001) == [(bytes(key(3)), b"three")]
    store.once["log:head"] = [NOT_READY] * mooncake_log.HEAD_TRIES
    assert log.append([(key(4), b"four")])  # unknown, but its last batch is kept: after it
    assert unpack_batch(store.values["log:3002"], 3002) == [(bytes(key(4)), b"four")]


def test_a_head_whose_read_failed_is_not_taken_for_no_head():
    """(taken for none, a writer knowing nothing would put at seq 1, removed long ago, and
    set the head back to it: no reader past it reads that batch)"""
    store = FakeStore()
    record_log(store, {seq: entries(seq) for seq in range(2000, 2004)}, head=2003)
    fresh = record_log(store, {}, head=2003)
    for code in (TRANSFER_FAIL, INVALID_PARAMS):
        store.once["log:head"] = [code] * mooncake_log.HEAD_TRIES
        before = dict(store.values)
        assert not fresh.append([(key(7), b"fresh")])
        assert store.values == before
    store.once["log:head"] = [TRANSFER_FAIL]  # once (its value replaced as it was sent): read again
    assert fresh.append([(key(7), b"fresh")])
    assert unpack_batch(store.values["log:2004"], 2004) == [(bytes(key(7)), b"fresh")]


def test_a_batch_the_store_keeps_failing_to_send_is_passed_over_after_a_while(monkeypatch):
    """At or below the head a failure is waited out for STALLED_S, as a batch still being
    put is: then passed over, rather than holding the reader until KEEP batches later."""
    from kvtier.remote import mooncake_log

    store, now = FakeStore(), [100.0]
    monkeypatch.setattr(mooncake_log.time, "monotonic", lambda: now[0])
    log = record_log(store, {1: entries(1), 2: entries(2), 3: entries(3)}, head=3)
    store.codes["log:2"] = TRANSFER_FAIL  # for good
    assert log.read(b"0", 10) == (b"1", entries(1))
    now[0] += mooncake_log.STALLED_S / 2
    assert log.read(b"1", 10) == (b"1", [])
    now[0] += mooncake_log.STALLED_S
    assert log.read(b"1", 10) == (b"3", entries(3))
