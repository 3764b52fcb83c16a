"""The segment log: a writer appends, readers follow from their last offset, rotations and
torn or damaged records never yield a wrong slot, and leases tell live writers from gone ones."""

import errno
import json
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvtier.io.format import INDEX_ENTRY_BYTES, MAGIC, Codec, SlotHeader
from kvtier.io.safefs import SafeDir, UnsafeEntry
from kvtier.keys import ChunkKey
from kvtier.segment.cachedir import CacheDir
from kvtier.segment.lease import Lease, LeaseInfo, LeaseWatch, read_lease
from kvtier.segment.lease_keeper import LeaseKeeper
from kvtier.segment.log import (
    LOG_HEADER_BYTES,
    RECORD_BYTES,
    LogFollower,
    encode_record,
    encode_records,
    entries_of,
)
from kvtier.segment.log_writer import SegmentLog
from kvtier.segment.names import LOG_FILE
from tests.helpers.disk_helpers import NS, RAW, chunk, key, make_tier

DIGEST = NS.digest()


def entry(n: int, namespace: bytes = DIGEST) -> bytes:
    header = SlotHeader(namespace, ChunkKey(n.to_bytes(16, "little")), Codec.NONE, RAW, RAW, n,
                        n, 0)
    return header.encode()[:INDEX_ENTRY_BYTES]


BLANK = bytes(INDEX_ENTRY_BYTES)


@pytest.fixture
def segment(tmp_path):
    with SafeDir.open(tmp_path) as directory:
        yield directory


def pair(segment, snapshot=(), rotate_after=1000):
    log = SegmentLog(segment, DIGEST, lambda: entries_of(snapshot), rotate_after)
    return log, LogFollower(segment, DIGEST, RAW)


def keys_of(follower) -> dict[int, int]:
    return {slot: int.from_bytes(key, "little") for slot, key in follower.slots.items()}


def test_a_follower_reads_only_what_was_appended_since_it_last_looked(segment):
    log, follower = pair(segment, snapshot=[(0, entry(100))])
    reset, changes = follower.refresh()
    assert reset and keys_of(follower) == {0: 100}
    first = follower.bytes_read
    for slot in range(1, 4):
        log.append(slot, entry(slot))
    reset, changes = follower.refresh()
    assert not reset and [c.slot for c in changes] == [1, 2, 3]
    assert follower.bytes_read - first == 3 * RECORD_BYTES
    log.append(2, BLANK)  # emptied
    log.append(1, entry(7))  # overwritten
    reset, changes = follower.refresh()
    assert {c.slot: c.header for c in changes}[2] is None
    assert keys_of(follower) == {0: 100, 1: 7, 3: 3}
    assert follower.refresh() == (False, [])  # nothing new: nothing read
    log.close()


def test_a_rotation_makes_followers_start_over_from_the_snapshot(segment):
    state = {0: 0}
    log = SegmentLog(segment, DIGEST, lambda: entries_of((s, entry(n)) for s, n in state.items()),
                     rotate_after=4)
    follower = LogFollower(segment, DIGEST, RAW)
    follower.refresh()
    for n in range(1, 6):
        state[n % 3] = n
        log.append(n % 3, entry(n))
    assert log.rotations == 1 and log.records < 5
    reset, _ = follower.refresh()
    assert reset and keys_of(follower) == state
    log.close()


def test_a_rotation_that_fails_for_space_keeps_the_old_log_and_tries_again_later(segment,
                                                                                 monkeypatch):
    """A full disk at a rotation: each record is still appended (no error for a write that
    was logged), followers read on, and the next try comes a quarter of ``rotate_after``
    records later, not at every append (each try snapshots the whole index)."""
    state, snapshots = {0: 0}, []

    def snapshot():
        snapshots.append(len(state))
        return entries_of((s, entry(n)) for s, n in state.items())

    log = SegmentLog(segment, DIGEST, snapshot, rotate_after=8)
    follower = LogFollower(segment, DIGEST, RAW)
    follower.refresh()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SafeDir, "replace_file", full)
    for n in range(1, 41):
        state[n % 5] = n
        log.append(n % 5, entry(n))  # never raises: the record is in the old log
    assert log.rotations == 0 and len(snapshots) == 1 + 11  # at records 9, 12, ..., 39
    reset, _ = follower.refresh()
    assert not reset and keys_of(follower) == state
    monkeypatch.undo()
    state[0] = 99
    log.append(0, entry(99))  # the try due now works
    assert log.rotations == 1
    reset, _ = follower.refresh()
    assert reset and keys_of(follower) == state
    log.close()


def test_a_rotation_whose_new_log_cannot_be_opened_is_tried_again_at_the_next_append(
        segment, monkeypatch):
    """The new log took the old one's place, then opening it failed (out of descriptors):
    records must not go on to the old file, which no reader follows any more."""
    state = {0: 0}
    log = SegmentLog(segment, DIGEST, lambda: entries_of((s, entry(n)) for s, n in state.items()),
                     rotate_after=8)
    follower = LogFollower(segment, DIGEST, RAW)
    follower.refresh()
    real, failures = SafeDir.open_file, [1]

    def open_file(self, name, *args, **kwargs):
        if name == LOG_FILE and failures:
            failures.pop()
            raise OSError(errno.EMFILE, "Too many open files")
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(SafeDir, "open_file", open_file)
    for n in range(1, 11):  # the rotation at the 8th record fails; the next append's works
        state[n % 4] = n
        log.append(n % 4, entry(n))
    assert log.rotations == 1
    follower.refresh()
    assert keys_of(follower) == state
    log.close()


def test_a_rotation_whose_snapshot_fails_after_a_good_one_waits_its_turn(segment):
    """A snapshot that fails (the index unreadable) replaces nothing: the next try comes
    rotate_after/4 records on, not at every append, even after a rotation that worked."""
    snapshots, failing = [], [False]

    def snapshot():
        snapshots.append(1)
        if failing[0]:
            raise OSError(errno.EIO, "Input/output error")
        return entries_of([(0, entry(0))])

    log = SegmentLog(segment, DIGEST, snapshot, rotate_after=8)
    for n in range(8):
        log.append(n % 4, entry(n))  # the rotation at the 8th record works
    assert log.rotations == 1
    failing[0] = True
    before = len(snapshots)
    for n in range(40):
        log.append(n % 4, entry(n))
    assert len(snapshots) - before <= 40 // 2 // 2 + 2  # a try every other record at most
    log.close()


def test_a_torn_last_record_waits_and_a_damaged_one_is_stepped_over(segment, tmp_path):
    log, follower = pair(segment)
    log.append(0, entry(1))
    fd = os.open(tmp_path / LOG_FILE, os.O_RDWR)
    end = LOG_HEADER_BYTES + RECORD_BYTES
    os.pwrite(fd, b"\x01" * 50, end)  # half a record at the end: a writer caught mid-append
    for _ in range(5):
        follower.refresh()
    assert keys_of(follower) == {0: 1} and follower.bad == 0
    log.append(1, entry(2))  # the writer's next record replaces the half one
    follower.refresh()
    assert keys_of(follower) == {0: 1, 1: 2}
    log.append(2, entry(3))
    log.append(3, entry(4))
    os.pwrite(fd, b"\xff" * 8, end + RECORD_BYTES + 20)  # damage inside slot 2's record
    for _ in range(4):
        follower.refresh()
    assert keys_of(follower) == {0: 1, 1: 2, 3: 4} and follower.bad == 1
    os.close(fd)
    log.close()


def short_pwrite(then: OSError | None):
    """``os.pwrite`` whose first call writes 50 bytes only (a full disk midway, a signal, a
    network filesystem); later calls raise ``then``, or write as asked when None."""
    real, calls = os.pwrite, []

    def pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) == 1:
            return real(fd, bytes(data)[:50], offset)
        if then is not None:
            raise then
        return real(fd, data, offset)

    return pwrite


def test_a_record_written_short_is_written_whole_before_the_log_goes_on(segment, tmp_path,
                                                                         monkeypatch):
    log, follower = pair(segment)
    follower.refresh()
    with monkeypatch.context() as patched:
        patched.setattr(os, "pwrite", short_pwrite(None))
        log.append(1, entry(1))  # the rest of the record is written by a second call
    log.append(2, entry(2))
    follower.refresh()
    assert keys_of(follower) == {1: 1, 2: 2} and follower.bad == 0
    size = LOG_HEADER_BYTES + 2 * RECORD_BYTES
    assert log.size == size == os.stat(tmp_path / LOG_FILE).st_size
    log.close()


def test_a_record_that_cannot_be_written_whole_leaves_the_end_at_the_last_whole_one(
        segment, tmp_path, monkeypatch):
    """The write fails after a short one: the append raises (its slot write fails), the
    log's end stays where the last whole record ends, the torn bytes past it are no record
    to a reader, and the next record is written over them."""
    log, follower = pair(segment)
    log.append(0, entry(5))
    end = LOG_HEADER_BYTES + RECORD_BYTES
    with monkeypatch.context() as patched:
        patched.setattr(os, "pwrite", short_pwrite(OSError(errno.ENOSPC, "No space left")))
        with pytest.raises(OSError):
            log.append(1, entry(1))
    assert log.size == end and os.stat(tmp_path / LOG_FILE).st_size == end + 50
    for _ in range(4):
        follower.refresh()
    assert keys_of(follower) == {0: 5} and follower.bad == 0
    log.append(2, entry(2))
    log.append(3, entry(3))
    for _ in range(4):
        follower.refresh()
    assert keys_of(follower) == {0: 5, 2: 2, 3: 3} and follower.bad == 0
    assert log.size == end + 2 * RECORD_BYTES == os.stat(tmp_path / LOG_FILE).st_size
    log.close()


def test_entries_of_another_namespace_are_not_taken(segment):
    log, follower = pair(segment)
    log.append(0, entry(1, namespace=bytes(16)))
    log.append(1, MAGIC + b"\x07" * (INDEX_ENTRY_BYTES - len(MAGIC)))  # a header that fails its check
    log.append(2, b"\x07" * INDEX_ENTRY_BYTES)  # no magic: an emptied slot
    follower.refresh()
    assert follower.slots == {} and follower.bad == 2
    log.close()


def test_a_log_of_another_namespace_or_replaced_by_junk_holds_nothing(segment, tmp_path):
    log, follower = pair(segment, snapshot=[(0, entry(1))])
    follower.refresh()
    log.close()
    (tmp_path / LOG_FILE).write_bytes(b"\0" * 4096)
    reset, _ = follower.refresh()
    assert reset and follower.slots == {}
    other = LogFollower(segment, bytes(16), RAW)
    SegmentLog(segment, DIGEST, lambda: entries_of([(0, entry(1))]), 10).close()
    assert other.refresh() == (False, []) and other.slots == {}


def test_a_log_that_is_gone_forgets_the_writer(segment, tmp_path):
    log, follower = pair(segment, snapshot=[(0, entry(1))])
    follower.refresh()
    log.close()
    (tmp_path / LOG_FILE).unlink()
    assert follower.refresh() == (True, []) and follower.slots == {}


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_log_that_is_not_a_regular_file_is_refused(segment, tmp_path, kind):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x")
    if kind == "symlink":
        (tmp_path / LOG_FILE).symlink_to(target)
    else:
        os.mkfifo(tmp_path / LOG_FILE)
    follower = LogFollower(segment, DIGEST, RAW)
    with pytest.raises(UnsafeEntry):
        follower.refresh()  # never follows, never blocks


def test_a_disk_tier_logs_every_write_and_blanking_of_its_segment(tmp_path):
    tier = make_tier([tmp_path], writers=["node-a"])
    with SafeDir.open(tmp_path / NS.id / "writers" / "node-a") as directory:
        follower = LogFollower(directory, DIGEST, RAW)
        for slot in range(3):
            assert tier.write(slot, key(slot), chunk(slot).array).ok
        follower.refresh()
        assert follower.slots == {s: key(s) for s in range(3)}
        tier.invalidate(1)
        follower.refresh()
        assert sorted(follower.slots) == [0, 2]
        tier.close()
        again = make_tier([tmp_path], writers=["node-a"])  # a restart starts a new log
        reset, _ = follower.refresh()
        assert reset and sorted(follower.slots) == [0, 2]
        again.close()


def test_a_lease_counts_up_and_reads_back(tmp_path):
    with SafeDir.open(tmp_path) as directory:
        lease = Lease(directory, "node-a", 120.0)
        lease.beat()
        lease.beat()
        info = read_lease(directory)
        assert isinstance(info, LeaseInfo)
        assert (info.instance, info.pid, info.beat) == ("node-a", os.getpid(), 2)
        keeper = LeaseKeeper(lambda: [lease], every=0.01)
        time.sleep(0.2)
        keeper.close()
        beats = read_lease(directory).beat
        assert beats > 2
        time.sleep(0.05)
        assert read_lease(directory).beat == beats  # closed: no more beats


def test_a_lease_that_stands_still_for_the_timeout_is_gone():
    now = [100.0]
    watch = LeaseWatch(timeout=30, clock=lambda: now[0])
    assert watch.observe("a", b"beat 1")  # first seen: live until watched long enough
    now[0] += 29
    assert watch.observe("a", b"beat 1")
    now[0] += 2
    assert not watch.observe("a", b"beat 1")
    assert watch.observe("a", b"beat 2")  # it beat again: live
    now[0] += 31
    assert not watch.observe("a", None)  # the lease file vanished (seen changing, then idle)
    assert watch.idle_for("a") == 31 and watch.idle_for("b") is None


@pytest.mark.parametrize(("stated_ms", "gone_after"), [
    (0, 30), (10_000, 30), (300_000, 300), (10**15, 86_400)])  # none, shorter, longer, absurd
def test_a_writer_is_gone_after_the_longer_of_the_readers_timeout_and_its_own(stated_ms,
                                                                              gone_after):
    now = [0.0]
    watch = LeaseWatch(timeout=30, clock=lambda: now[0])
    data = LeaseInfo("a", "h", 1, 2, 3, 4, 5, stated_ms).encode()
    assert watch.observe("a", data)
    now[0] = gone_after - 1
    assert watch.observe("a", data) and watch.live("a")
    now[0] = gone_after + 1
    assert not watch.observe("a", data) and not watch.live("a")
    assert watch.live("never seen")
    closed = LeaseInfo("b", "h", 1, 2, 3, 4, 5, stated_ms, 6).encode()  # its writer closed it
    now[0] = 0.0
    assert watch.observe("b", closed)
    now[0] = 31
    assert not watch.observe("b", closed)  # the reader's own timeout: nothing beats any more


def test_a_lease_states_its_writers_timeout(tmp_path):
    with SafeDir.open(tmp_path) as directory:
        Lease(directory, "node-a", 2.5).beat()
        assert read_lease(directory).timeout_ms == 2500
    older = {"instance": "a", "host": "h", "pid": 1, "beat": 2, "started_ns": 3, "written_ns": 4}
    assert LeaseInfo.parse(json.dumps(older).encode()).timeout_ms == 0  # an older kvtier's
    assert LeaseInfo.parse(json.dumps({**older, "timeout_ms": -1}).encode()) is None


def test_junk_in_a_lease_file_is_no_lease(tmp_path):
    (tmp_path / "lease").write_bytes(b"\xff" * 100)
    with SafeDir.open(tmp_path) as directory:
        assert read_lease(directory) is None
    (tmp_path / "lease").write_bytes(b"{" * 5000)
    with SafeDir.open(tmp_path) as directory:
        assert read_lease(directory) is None


def test_neighbouring_chunks_of_another_writer_move_in_one_call_each_checked(tmp_path,
                                                                              monkeypatch):
    from kvtier.io.buffers import AlignedBuffer
    from kvtier.shared.reads import OtherReads
    from kvtier.shared.view import SharedView

    tier = make_tier([tmp_path], writers=["a"])
    chunks = {slot: chunk(slot) for slot in range(4)}
    assert all(tier.write(s, key(s), c.array).ok for s, c in chunks.items())
    view = SharedView([str(tmp_path)], NS, RAW, ("b",), 30)
    view.refresh()
    reads = OtherReads([str(tmp_path)], NS, RAW, tier.stride, [False])
    (slots,) = tmp_path.glob("*/writers/a/slots-0000.kvt")
    data = bytearray(slots.read_bytes())
    data[2 * tier.stride + 4096 + 7] ^= 0xFF  # slot 2's payload
    slots.write_bytes(bytes(data))
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: (calls.append(1), real(*a))[1])
    outs = {s: AlignedBuffer(RAW, pin=False) for s in chunks}
    order = [3, 0, 2, 1]
    results = reads.read_many([(view.ref(view.find(key(s))), outs[s].array) for s in order])
    assert len(calls) == 1
    assert [r.ok for r in results] == [True, True, False, True]  # 3, 0, 2 (damaged), 1
    for s in (0, 1, 3):
        assert bytes(outs[s].array[:RAW]) == bytes(chunks[s].array[:RAW])
    reads.close()
    view.close()
    tier.close()


def test_a_compressed_chunk_whose_log_says_a_longer_payload_than_its_slot_is_corrupt(tmp_path):
    """A writer's log naming a payload longer than its slot's header says (a stale record,
    or a hostile one) never has bytes the slot's checksum does not cover decoded: CORRUPT."""
    import dataclasses

    from kvtier.io.buffers import AlignedBuffer
    from kvtier.io.format import HEADER_BYTES, decode_header
    from kvtier.shared.reads import OtherReads
    from kvtier.shared.view import SharedView
    from tests.helpers.cowriter import write_log

    tier = make_tier([tmp_path], writers=["a"], compression=True)
    flat = AlignedBuffer(RAW, pin=False)
    flat.array[:] = 7  # compresses well
    assert tier.write(0, key(0), flat.array).ok
    (slots,) = tmp_path.glob("*/writers/a/slots-0000.kvt")
    header = decode_header(slots.read_bytes()[:HEADER_BYTES])
    assert header.codec is not Codec.NONE and header.payload_bytes < RAW
    reads = OtherReads([str(tmp_path)], NS, RAW, tier.stride, [False])
    out = AlignedBuffer(RAW, pin=False)
    for extra, ok in ((0, True), (64, False)):
        told = dataclasses.replace(header, payload_bytes=header.payload_bytes + extra)
        write_log(tmp_path, "a", [(0, told.encode()[:INDEX_ENTRY_BYTES])])
        view = SharedView([str(tmp_path)], NS, RAW, ("b",), 30)
        view.refresh()
        got = reads.read_many([(view.ref(view.find(key(0))), out.array)])[0]
        assert got.ok is ok, got
        assert ok or "where the slot was recorded" in got.detail
        view.close()
    reads.close()
    tier.close()


def test_records_encoded_at_once_are_those_encoded_one_by_one():
    rng = np.random.default_rng(7)
    pairs = [(int(slot), rng.bytes(INDEX_ENTRY_BYTES)) for slot in rng.integers(0, 2**40, 300)]
    assert encode_records(entries_of(pairs)) == b"".join(encode_record(s, e) for s, e in pairs)
    assert encode_records(entries_of([])) == b""


def test_a_writer_starts_its_log_from_the_written_entries_of_its_index_only(segment):
    """A partly written last entry (a truncated index) and blank entries are left out."""
    written = [entry(n) for n in (1, 2)]
    index = written[0] + BLANK + written[1] + written[1][:50]
    snapshot = CacheDir._index_snapshot(SimpleNamespace(read_index=lambda: index))
    log = SegmentLog(segment, DIGEST, lambda: snapshot, 1000)
    follower = LogFollower(segment, DIGEST, RAW)
    follower.refresh()
    assert keys_of(follower) == {0: 1, 2: 2}
    log.close()


def test_a_follower_knows_no_slot_past_its_bound_nor_more_slots_than_its_room(segment):
    """A log (hostile, or of a writer given far more disk) naming slots up to 2**24 would
    take gigabytes of a reader's memory: slots at or past ``max_slots`` are junk, and
    ``room`` caps how many slots are known (further ones are passed over, as misses)."""
    log = SegmentLog(segment, DIGEST, lambda: entries_of(()), 1000)
    follower = LogFollower(segment, DIGEST, RAW, max_slots=8)
    for slot in (0, 7, 8, 1 << 20):
        log.append(slot, entry(slot + 1))
    follower.refresh()
    assert keys_of(follower) == {0: 1, 7: 8} and follower.bad == 2
    for slot in range(1, 5):
        log.append(slot, entry(slot + 1))
    log.append(0, entry(50))  # a slot already known is updated even with no room left
    follower.refresh(room=3)
    assert keys_of(follower) == {0: 50, 7: 8, 1: 2} and follower.over == 3
    log.append(5, BLANK)
    follower.refresh(room=3)
    assert len(follower.slots) == 3
    log.close()
