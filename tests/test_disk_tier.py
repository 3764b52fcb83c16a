"""The DiskTier contract on real files: round trips, verification, recovery, striping."""

import errno
import os
import stat
import time

import numpy as np
import pytest

from kvtier.io.buffers import AlignedBuffer
from kvtier.io.format import HEADER_BYTES, INDEX_ENTRY_BYTES
from kvtier.io.result import IOStatus
from kvtier.segment.cachedir import CacheDir
from tests.helpers.disk_helpers import NS, RAW, chunk, key, make_tier, slot_files


@pytest.fixture(params=[False, True], ids=["raw", "zstd"])
def compression(request):
    return request.param


def read_back(tier, slot, k):
    out = AlignedBuffer(RAW, pin=False)
    return tier.read(slot, k, out.array), out.array[:RAW]


def test_round_trip(tmp_path, compression):
    tier = make_tier([tmp_path], compression=compression)
    data = chunk(1)
    if compression:  # compressible bytes so the codec is really used
        data.array[: RAW // 2] = 7
    assert tier.write(3, key(1), data.array).ok
    result, got = read_back(tier, 3, key(1))
    assert result.ok and np.array_equal(got, data.array[:RAW])
    if compression:
        assert result.nbytes < HEADER_BYTES + RAW
    tier.close()


def test_wrong_key_blank_slot_and_other_namespace_are_corrupt(tmp_path):
    tier = make_tier([tmp_path])
    tier.write(0, key(1), chunk(1).array)
    assert read_back(tier, 0, key(2))[0].status is IOStatus.CORRUPT
    assert read_back(tier, 5, key(5))[0].status is IOStatus.CORRUPT  # never written
    tier.close()


def test_every_flipped_byte_is_caught(tmp_path):
    tier = make_tier([tmp_path], slots_per_path=1)
    tier.write(0, key(1), chunk(1).array)
    (path,) = slot_files(tmp_path)
    rng = np.random.default_rng(0)
    for offset in [0, 9, 40, 72, 90, HEADER_BYTES, HEADER_BYTES + RAW - 1,
                   *rng.integers(HEADER_BYTES, HEADER_BYTES + RAW, size=8)]:
        original = path.read_bytes()
        flipped = bytearray(original)
        flipped[offset] ^= 0x10
        path.write_bytes(bytes(flipped))
        result, _ = read_back(tier, 0, key(1))
        assert result.status is IOStatus.CORRUPT, f"flip at {offset} not caught"
        path.write_bytes(original)
    assert read_back(tier, 0, key(1))[0].ok
    tier.close()


def test_truncated_file_is_corrupt_not_a_crash(tmp_path):
    tier = make_tier([tmp_path], slots_per_path=2)
    tier.write(1, key(1), chunk(1).array)
    (path,) = slot_files(tmp_path)
    size = tier.stride + HEADER_BYTES + 100
    tier.close()
    os.truncate(path, size)
    tier = make_tier([tmp_path], slots_per_path=2)
    tier.recover()
    assert read_back(tier, 1, key(1))[0].status is IOStatus.CORRUPT
    tier.close()


def test_recovery_finds_what_was_written(tmp_path, compression):
    tier = make_tier([tmp_path], compression=compression)
    for slot in range(5):
        assert tier.write(slot, key(slot), chunk(slot).array).ok
    tier.close()
    tier = make_tier([tmp_path])
    report = tier.recover()
    assert sorted((r.slot, r.header.key) for r in report.slots) == [(s, key(s)) for s in range(5)]
    assert report.torn == 0
    for slot in range(5):
        result, got = read_back(tier, slot, key(slot))
        assert result.ok and np.array_equal(got, chunk(slot).array[:RAW])
    tier.close()


def test_recovery_without_the_index_scans_slot_headers(tmp_path):
    tier = make_tier([tmp_path])
    for slot in range(3):
        tier.write(slot, key(slot), chunk(slot).array)
    tier.close()
    (index,) = tmp_path.glob("*/writers/*/index.kvt")
    index.unlink()
    tier = make_tier([tmp_path])
    assert len(tier.recover().slots) == 3
    tier.close()
    tier = make_tier([tmp_path])  # the scan rebuilt the index
    assert (tmp_path / NS.id / "writers" / tier.writer / "index.kvt").stat().st_size > 0
    assert len(tier.recover().slots) == 3
    tier.close()


def test_an_index_rebuilt_by_a_scan_holds_one_entry_at_a_time(tmp_path, monkeypatch):
    """A start that scans slot headers writes the new index from entries made one by one,
    each an index entry's bytes: not a list of whole 4 KiB headers (4 GiB at 1M chunks)."""
    tier = make_tier([tmp_path])
    for slot in range(3):
        tier.write(slot, key(slot), chunk(slot).array)
    tier.close()
    next(tmp_path.glob("*/writers/*/index.kvt")).unlink()
    real, given = CacheDir.replace_index, []

    def replace_index(self, entries):
        given.append(entries)
        return real(self, (given.append(len(entry)) or (slot, entry) for slot, entry in entries))

    monkeypatch.setattr(CacheDir, "replace_index", replace_index)
    tier = make_tier([tmp_path])
    assert len(tier.recover().slots) == 3
    tier.close()
    assert not isinstance(given[0], list | tuple) and given[1:] == [INDEX_ENTRY_BYTES] * 3


def test_recovery_keeps_the_newest_copy_of_a_key(tmp_path):
    tier = make_tier([tmp_path])
    tier.write(0, key(9), chunk(1).array)
    tier.write(4, key(9), chunk(2).array)
    tier.close()
    tier = make_tier([tmp_path])
    report = tier.recover()
    assert [(r.slot, r.header.key) for r in report.slots] == [(4, key(9))]
    assert report.duplicates == 1
    tier.close()


def test_torn_headers_are_dropped_at_recovery(tmp_path):
    tier = make_tier([tmp_path])
    for slot in range(3):
        tier.write(slot, key(slot), chunk(slot).array)
    tier.close()
    (index,) = tmp_path.glob("*/writers/*/index.kvt")
    data = bytearray(index.read_bytes())
    data[128 + 50] ^= 1  # slot 1's entry
    index.write_bytes(bytes(data))
    tier = make_tier([tmp_path])
    report = tier.recover()
    assert sorted(r.slot for r in report.slots) == [0, 2] and report.torn == 1
    tier.close()


def test_invalidated_slots_do_not_come_back(tmp_path):
    tier = make_tier([tmp_path])
    tier.write(2, key(2), chunk(2).array)
    assert tier.invalidate(2).ok
    assert read_back(tier, 2, key(2))[0].status is IOStatus.CORRUPT
    tier.close()
    tier = make_tier([tmp_path])
    assert tier.recover().slots == []
    tier.close()


def test_chunks_stripe_across_paths(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(mode=0o700)
    b.mkdir(mode=0o700)
    tier = make_tier([a, b], slots_per_path=4)
    assert tier.num_slots == 8 and tier.queues == ["disk0", "disk1"]
    assert list(tier.slots_of_path(1)) == [1, 3, 5, 7]
    for slot in range(4):
        tier.write(slot, key(slot), chunk(slot).array)
    assert slot_files(a) and slot_files(b)
    assert {tier.queue_of(s) for s in range(4)} == {"disk0", "disk1"}
    tier.close()


def test_files_and_directories_are_private(tmp_path):
    tier = make_tier([tmp_path])
    tier.write(0, key(0), chunk(0).array)
    for path in (tmp_path / NS.id).rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    assert stat.S_IMODE((tmp_path / NS.id).stat().st_mode) == 0o700
    assert (tmp_path / NS.id / "writers" / tier.writer / "lease").is_file()
    tier.close()


def test_few_large_files_not_one_per_chunk(tmp_path):
    tier = make_tier([tmp_path], slots_per_path=64)
    for slot in range(64):
        tier.write(slot, key(slot), chunk(slot).array)
    assert len(slot_files(tmp_path)) == 1
    tier.close()


def test_o_direct_is_probed_and_can_be_turned_off(tmp_path):
    tier = make_tier([tmp_path], o_direct=False)
    assert tier.o_direct == {str(tmp_path): False}
    tier.close()
    tier = make_tier([tmp_path])
    assert isinstance(tier.o_direct[str(tmp_path)], bool)
    tier.close()


def test_a_segment_is_held_by_one_process_at_a_time(tmp_path):
    first = make_tier([tmp_path], writers=["node-a"])
    second = make_tier([tmp_path], writers=["node-a"])
    assert "in use by another kvtier process" in second.down_paths[0]
    assert second.write(0, key(0), chunk(0).array).status is IOStatus.PATH_DOWN
    first.close()
    second.close()
    third = make_tier([tmp_path], writers=["node-a"])
    assert third.down_paths == {}
    third.close()


def test_without_an_instance_id_each_tier_takes_the_lowest_free_writer_id(tmp_path):
    first, second = make_tier([tmp_path], share_writers=2), make_tier([tmp_path], share_writers=2)
    assert first.down_paths == second.down_paths == {}
    host = first.writer.rsplit("-", 1)[0]
    assert (first.writer, second.writer) == (f"{host}-0", f"{host}-1")
    for tier in (first, second):
        assert tier.write(0, key(0), chunk(0).array).ok
    first.close()
    again = make_tier([tmp_path], share_writers=2)  # a restart takes its segment back
    assert again.writer == f"{host}-0" and len(again.recover().slots) == 1
    again.close()
    second.close()


def test_neighbouring_slots_move_in_one_call_each_way(tmp_path, monkeypatch):
    tier = make_tier([tmp_path], slots_per_path=16)
    calls = {"preadv": 0, "pwritev": 0}
    for name in calls:
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, _name=name: (
            calls.__setitem__(_name, calls[_name] + 1), _real(*a))[1])
    chunks = {slot: chunk(slot) for slot in (3, 4, 5, 6, 9)}
    results = tier.write_many([(s, key(s), c.array) for s, c in chunks.items()])
    assert all(r.ok for r in results) and calls["pwritev"] == 2  # 3-6, then 9
    outs = {slot: AlignedBuffer(RAW, pin=False) for slot in chunks}
    results = tier.read_many([(s, key(s), outs[s].array) for s in (9, 5, 3, 4, 6)])
    assert all(r.ok for r in results) and calls["preadv"] == 2
    for slot, data in chunks.items():
        assert np.array_equal(outs[slot].array[:RAW], data.array[:RAW])
    tier.close()


def test_one_bad_slot_in_a_batch_fails_alone(tmp_path):
    tier = make_tier([tmp_path], slots_per_path=8)
    tier.write_many([(s, key(s), chunk(s).array) for s in range(4)])
    (path,) = slot_files(tmp_path)
    data = bytearray(path.read_bytes())
    data[2 * tier.stride + HEADER_BYTES + 7] ^= 1
    path.write_bytes(bytes(data))
    outs = [AlignedBuffer(RAW, pin=False) for _ in range(4)]
    results = tier.read_many([(s, key(s), outs[s].array) for s in range(4)])
    assert [r.status for r in results] == [IOStatus.OK, IOStatus.OK, IOStatus.CORRUPT, IOStatus.OK]
    assert np.array_equal(outs[3].array[:RAW], chunk(3).array[:RAW])
    tier.close()


def test_one_unreadable_slot_in_a_batch_fails_alone_and_keeps_the_path(tmp_path, monkeypatch):
    """A bad sector under one slot: the vectored read over its neighbours fails with EIO;
    they are read again one by one, so only that slot fails, and one error does not count
    as many towards taking the path out."""
    tier = make_tier([tmp_path], slots_per_path=8)
    tier.write_many([(s, key(s), chunk(s).array) for s in range(4)])
    real, bad = os.preadv, 2 * tier.stride

    def preadv(fd, buffers, offset):
        size = sum(memoryview(b).nbytes for b in buffers)
        if "slots-" in os.readlink(f"/proc/self/fd/{fd}") and offset <= bad < offset + size:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    outs = [AlignedBuffer(RAW, pin=False) for _ in range(4)]
    results = tier.read_many([(s, key(s), outs[s].array) for s in range(4)])
    assert [r.status for r in results] == [IOStatus.OK, IOStatus.OK, IOStatus.IO_ERROR, IOStatus.OK]
    assert all(np.array_equal(outs[s].array[:RAW], chunk(s).array[:RAW]) for s in (0, 1, 3))
    assert tier.down_paths == {}
    tier.close()


def test_a_batch_past_the_end_of_a_truncated_file(tmp_path):
    tier = make_tier([tmp_path], slots_per_path=8)
    tier.write_many([(s, key(s), chunk(s).array) for s in range(4)])
    (path,) = slot_files(tmp_path)
    os.truncate(path, 2 * tier.stride + 100)
    outs = [AlignedBuffer(RAW, pin=False) for _ in range(4)]
    results = tier.read_many([(s, key(s), outs[s].array) for s in range(4)])
    assert [r.ok for r in results] == [True, True, False, False]
    tier.close()


def test_a_failure_on_a_directory_already_replaced_leaves_the_new_one_up(tmp_path):
    """A request still running on a path's old directory when the path came back must
    not take the revived path down again, nor reopen files of the closed directory."""
    disk = make_tier([tmp_path], retry=0.001)
    path = disk.paths[0]
    old = path.dir
    disk.paths.take_down(path, "test")
    time.sleep(0.01)
    assert disk.revive(0) and path.dir is not old
    with pytest.raises(OSError) as closed:
        old.fd(0)
    result = disk.paths.failed(path, closed.value, old)
    assert result.status is IOStatus.IO_ERROR and not disk.down_paths
    disk.close()


def test_a_failed_open_does_not_keep_the_namespace_locked(tmp_path, monkeypatch):
    from kvtier.segment import cachedir
    real = cachedir.probe_o_direct

    def broken(directory):
        raise OSError(errno.EIO, "probe failed")

    monkeypatch.setattr(cachedir, "probe_o_direct", broken)
    disk = make_tier([tmp_path])
    assert "probe failed" in disk.down_paths[0]
    monkeypatch.setattr(cachedir, "probe_o_direct", real)
    again = make_tier([tmp_path])  # same process: a leaked lock would refuse it (EBUSY)
    assert not again.down_paths
    again.close()
    disk.close()


def test_an_uncompressed_header_claiming_a_shorter_payload_is_corrupt(tmp_path):
    """A header (checksum and all, as anyone who can write the file can make it) saying an
    uncompressed payload is shorter than the chunk would leave the rest unverified."""
    from kvtier.io.format import SlotHeader, decode_header, payload_checksum

    tier = make_tier([tmp_path], slots_per_path=1)
    data = chunk(1)
    assert tier.write(0, key(1), data.array).ok
    (path,) = slot_files(tmp_path)
    raw = bytearray(path.read_bytes())
    header = decode_header(bytes(raw[:HEADER_BYTES]))
    short = 4096
    forged = SlotHeader(header.namespace, header.key, header.codec, short, header.raw_bytes,
                        payload_checksum(bytes(raw[HEADER_BYTES:HEADER_BYTES + short])),
                        header.generation, header.created_ns)
    raw[:HEADER_BYTES] = forged.encode()
    raw[HEADER_BYTES + short + 10] ^= 0xFF  # a wrong byte past the claimed payload
    path.write_bytes(bytes(raw))
    assert read_back(tier, 0, key(1))[0].status is IOStatus.CORRUPT
    tier.close()


def test_an_index_replaced_keeps_its_new_descriptor_when_closing_the_old_one_fails(
        tmp_path, monkeypatch):
    """(a close on NFS may report a failed write-back: the descriptor is closed all the same,
    and its number may soon name another file, which a later close must not close)"""
    from kvtier.segment import cachedir

    tier = make_tier([tmp_path])
    directory = tier.paths[0].dir
    old, real, failed = directory.index_fd, os.close, []

    def close(fd):
        real(fd)
        if fd == old and not failed:
            failed.append(fd)
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(cachedir.os, "close", close)
    directory.replace_index([])
    monkeypatch.undo()
    assert failed and directory.index_fd != old and stat.S_ISREG(os.fstat(directory.index_fd).st_mode)
    tier.close()


def test_a_write_tried_again_keeps_the_stamp_its_slot_was_given(tmp_path, monkeypatch):
    """Stamps follow the order slots were reserved in (a prompt's head first: ``kvtier gc``
    reads that order), a write tried again after a failure included: it does not become the
    last one written."""
    from kvtier.disk import writes

    tier = make_tier([tmp_path])
    for slot in range(3):
        tier.stamps.reserve(slot)
    real, calls = writes.write_fully, []

    def first_fails(fd, iov, offset):
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, iov, offset)

    monkeypatch.setattr(writes, "write_fully", first_fails)
    assert not tier.write(0, key(0), chunk(0).array).ok
    assert tier.write(1, key(1), chunk(1).array).ok and tier.write(2, key(2), chunk(2).array).ok
    assert tier.write(0, key(0), chunk(0).array).ok  # tried again
    headers = dict(tier.scan_headers([0, 1, 2])[0])
    assert headers[0].generation < headers[1].generation < headers[2].generation
    tier.close()


def test_a_try_of_a_path_that_does_not_answer_leaves_its_old_files_alone(tmp_path, monkeypatch):
    """A path taken down because its mount hung is tried again: while it still does not
    answer, its old directory is not closed (a close may wait on the dead server for ever,
    and hold the thread that tries), and it is not opened; once it answers, both happen."""
    from kvtier.disk import paths as paths_module

    disk = make_tier([tmp_path], retry=0.001)
    path = disk.paths[0]
    old = path.dir
    disk.paths.take_down(path, "test: a hung mount")
    closes = []
    monkeypatch.setattr(old, "close", lambda: closes.append(True))
    monkeypatch.setattr(paths_module, "answers", lambda root, timeout: False)
    time.sleep(0.01)
    assert not disk.revive(0) and closes == [] and path.dir is None and path.stale is old
    monkeypatch.undo()
    time.sleep(0.01)
    path.retry_at = 0.0  # due again at once
    assert disk.revive(0) and path.dir is not None and path.dir is not old
    disk.close()


def test_a_path_whose_file_system_was_unmounted_is_not_reopened_on_the_disk_beneath(tmp_path):
    """A network mount taken away (unmounted, lazily or not) leaves its path a plain
    directory of the file system beneath, the root disk say: a try of the path does not
    reopen it there (the cache would fill a disk not meant for it), until a file system is
    mounted where it was again."""
    from kvtier.io.mounts import mount_point_of

    disk = make_tier([tmp_path], retry=0.001)
    path = disk.paths[0]
    assert path.mount_point == mount_point_of(str(tmp_path))
    disk.paths.take_down(path, "test: its server went away")
    path.mount_point = str(tmp_path)  # as if its file system had been mounted right there
    time.sleep(0.01)
    assert not disk.revive(0) and path.dir is None
    assert f"the file system mounted at {tmp_path} is gone" in disk.paths.down[0]
    path.mount_point, path.retry_at = mount_point_of(str(tmp_path)), 0.0  # mounted again
    assert disk.revive(0) and path.dir is not None
    disk.close()


def test_a_path_out_at_start_knows_where_its_file_system_was_mounted(tmp_path):
    """(a mount hung at start, then unmounted lazily: its path is not reopened on the disk
    beneath, whose old cache there would be read back as its own)"""
    from kvtier.io.mounts import mount_point_of

    disk = make_tier([tmp_path / "missing"], retry=0.001)
    path = disk.paths[0]
    assert path.dir is None and path.mount_point == mount_point_of(str(tmp_path / "missing"))
    assert path.mount_point is not None
    disk.close()
