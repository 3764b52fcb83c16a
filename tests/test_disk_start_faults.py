"""Faults at start-up and around the edges of the disk tier: a full or failing disk while
reading back what a path holds takes that path out (never an exception out of the store), the
index is rebuilt whole or not at all, a full disk is ENOSPC and never an I/O error, files a
killed writer left are removed when its segment opens again, blanking a corrupt slot never
holds a get past load_timeout, and every call tries paths that are due again."""

import errno
import os
import shutil
import threading
import time

import pytest

from kvtier import KVStore
from kvtier.io import safefs
from kvtier.io.format import HEADER_BYTES
from kvtier.segment import cachedir
from tests.helpers.disk_helpers import wait_until
from tests.helpers.faults import flip, slot_of, stored
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.store import STRIDE, config, exact, seq


def without_index(tmp_path, chunks=6):
    """A segment holding ``chunks`` chunks of seq(0) whose index file was lost."""
    store, tokens = stored(tmp_path, chunks)
    store.close()
    (index,) = tmp_path.glob("*/writers/*/index.kvt")
    index.unlink()
    return tokens


def test_a_full_disk_while_the_index_is_rebuilt_takes_the_path_out_and_loses_nothing(
        tmp_path, monkeypatch):
    tokens = without_index(tmp_path)
    calls = []
    real = cachedir.write_all

    def full_after_two(fd, data, offset=None):
        calls.append(1)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    monkeypatch.setattr(cachedir, "write_all", full_after_two)
    with KVStore(SMALL, config(tmp_path)) as store:  # no exception out of the store
        (reason,) = store.stats().paths_down.values()
        assert "cannot read back what it holds" in reason and "No space" in reason
        assert store.stats().recovered_chunks == 0
    monkeypatch.undo()
    (segment,) = tmp_path.glob("*/writers/*")
    assert not [n for n in os.listdir(segment) if ".tmp-" in n]
    with KVStore(SMALL, config(tmp_path)) as store:  # the index was left empty: scanned again
        assert store.stats().recovered_chunks == 6 and exact(store, tokens) == 6 * CHUNK
    with KVStore(SMALL, config(tmp_path)) as store:  # and now rebuilt whole
        assert store.stats().recovered_chunks == 6


def test_an_io_error_reading_the_index_takes_the_path_out(tmp_path, monkeypatch):
    store, tokens = stored(tmp_path)
    store.close()

    real, calls = cachedir.CacheDir.read_index, []

    def failing_at_recovery(self):  # the log's snapshot at open reads it first
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(self)

    monkeypatch.setattr(cachedir.CacheDir, "read_index", failing_at_recovery)
    with KVStore(SMALL, config(tmp_path)) as store:
        assert "Input/output error" in next(iter(store.stats().paths_down.values()))
        assert exact(store, tokens) == 0  # served by nothing, never an exception


def test_a_short_write_goes_on_and_a_full_disk_is_enospc(tmp_path, monkeypatch):
    real = os.write
    calls = []

    def half_then_full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    with safefs.SafeDir.open(tmp_path) as directory:
        monkeypatch.setattr(os, "write", half_then_full)
        with pytest.raises(OSError) as raised:
            directory.replace_file("log.kvt", b"x" * 1000)
        monkeypatch.undo()
        assert raised.value.errno == errno.ENOSPC and calls == [1000, 500]
        directory.replace_file("log.kvt", b"y" * 1000)
    assert os.listdir(tmp_path) == ["log.kvt"]


def test_files_a_killed_writer_left_in_its_segment_are_removed_when_it_opens_again(tmp_path):
    store, tokens = stored(tmp_path)
    store.close()
    (segment,) = tmp_path.glob("*/writers/*")
    left = [".log.kvt.tmp-4242-0123abcd", ".lease.tmp-4242-89abcdef", ".index.kvt.tmp-7-00ff00ff",
            ".o_direct_probe-4242-deadbeef"]
    for name in [*left, ".notes.tmp-1", "mine.txt"]:
        (segment / name).write_bytes(b"x" * 4096)
    os.mkfifo(segment / ".lease.tmp-4243-00000000")  # not a regular file: never touched
    with KVStore(SMALL, config(tmp_path)) as store:
        assert exact(store, tokens) == 6 * CHUNK
    names = set(os.listdir(segment))
    assert not names & set(left)
    assert {".notes.tmp-1", "mine.txt", ".lease.tmp-4243-00000000"} <= names


def test_blanking_a_corrupt_slot_on_a_hung_drive_never_holds_a_get_past_load_timeout(
        tmp_path, monkeypatch):
    store, tokens = stored(tmp_path, load_timeout="0.5s")
    slot = slot_of(store, tokens, 0)
    (data,) = tmp_path.glob("*/writers/*/slots-0000.kvt")
    flip(data, slot * STRIDE + HEADER_BYTES + 99)
    release = threading.Event()
    real = os.pwritev

    def hung_writes(fd, buffers, offset, *args):
        if "slots-" in os.readlink(f"/proc/self/fd/{fd}"):
            release.wait(30)  # the drive stops answering writes; reads still answer
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "pwritev", hung_writes)
    try:
        started = time.monotonic()
        assert exact(store, tokens) == 0  # the corrupt first chunk ends the prefix
        assert time.monotonic() - started < 10  # not the 30 s the blanking write hangs
        assert store.stats().corruptions + store.stats().load_timeouts >= 1
    finally:
        release.set()
        monkeypatch.undo()
        store.close()


def test_a_path_out_of_service_comes_back_through_gets_and_flushes_alone(tmp_path, monkeypatch):
    from kvtier.disk import tier as disk_module
    monkeypatch.setattr(disk_module, "_HEALTH_EVERY_S", 0.0)
    tokens = seq(0, 2)
    with KVStore(SMALL, config(tmp_path, host_chunks=4, disk_retry="0.05s")) as store:
        store.put(tokens, make_kv(tokens))
        store.flush()
        for entry in tmp_path.iterdir():  # the namespace's directory removed under the store
            shutil.rmtree(entry)
        store.put(seq(100, 1), make_kv(seq(100, 1)))  # its write finds the path gone
        wait_until(lambda: bool(store.stats().paths_down), "the path was never taken out")

        def back():
            store.lookup(tokens)
            exact(store, tokens)
            return bool(store.flush())

        wait_until(back, "the path never came back through gets, lookups and flushes")
        assert store.stats().paths_back >= 1 and not store.stats().paths_down


def test_a_header_read_that_fails_once_in_the_scan_is_tried_again(tmp_path, monkeypatch):
    """The index lost, start-up scans the slots' headers and writes the index anew from
    what it found: one read failing with a passing EIO left its slot out of that index,
    which every later start trusted: the chunk was lost for good. A failed header read is
    tried again now; the chunks are all there after a write and another restart too.
    Found by a review."""
    from tests.helpers.disk_helpers import chunk, key, make_tier

    tier = make_tier([tmp_path], slots_per_path=4, o_direct=False)
    for i in range(3):
        assert tier.write(i, key(i), chunk(i).array).ok
    tier.close()
    (index,) = tmp_path.glob("*/writers/*/index.kvt")
    index.unlink()
    real, stride, failed = os.preadv, tier.stride, []

    def eio_once(fd, bufs, offset, *rest):
        if "slots-" in os.readlink(f"/proc/self/fd/{fd}") and offset == stride and not failed:
            failed.append(offset)
            raise OSError(errno.EIO, "passing")
        return real(fd, bufs, offset, *rest)

    monkeypatch.setattr(os, "preadv", eio_once)
    tier = make_tier([tmp_path], slots_per_path=4, o_direct=False)
    assert {r.slot for r in tier.recover(threads=1).slots} == {0, 1, 2} and failed
    assert tier.write(3, key(3), chunk(3).array).ok
    tier.close()
    monkeypatch.setattr(os, "preadv", real)
    tier = make_tier([tmp_path], slots_per_path=4, o_direct=False)
    assert {r.slot for r in tier.recover(threads=1).slots} == {0, 1, 2, 3}
    tier.close()


def test_a_slot_write_cut_short_leaves_no_index_entry_naming_its_old_chunk(tmp_path, monkeypatch):
    """A chunk K on disk, its slot then written with J, the write cut short (the header made
    it, the payload did not), a clean close: the index still named K there, a restart took
    K for on disk unread, and a put and flush of K wrote nothing (flush said it was on
    disk); the next restart had lost K. The entries of the slots a write overwrites are
    blanked before it now. Found by a review."""
    from tests.helpers.store import load

    k, j = seq(0, 1), seq(1000, 1)
    cfg = config(tmp_path, host_chunks=1, disk_chunks=1, o_direct=False)
    with KVStore(SMALL, cfg) as store:
        store.put(k, make_kv(k))
        assert store.flush()
        real, cut = os.pwritev, []

        def short(fd, buffers, offset, *rest):
            if "slots-" in os.readlink(f"/proc/self/fd/{fd}") and len(buffers) > 1:
                cut.append(offset)
                return real(fd, buffers[:1], offset)  # the header only
            if cut and cut[-1] < offset:  # the rest, asked for again: the device wrote none
                return 0
            return real(fd, buffers, offset, *rest)

        monkeypatch.setattr(os, "pwritev", short)
        store.put(j, make_kv(j))  # K leaves host memory; J takes its disk slot
    monkeypatch.setattr(os, "pwritev", real)  # after the close: its write ran before it
    with KVStore(SMALL, cfg) as store:
        assert store.stats().recovered_chunks == 0  # neither K nor J is on disk
        store.put(k, make_kv(k))
        assert store.flush()  # (written through: on disk now)
    with KVStore(SMALL, cfg) as store:
        assert load(store, k)[0] == len(k)


def test_a_kill_between_a_slot_write_and_its_index_entry_loses_no_flushed_chunk(tmp_path):
    """The same, killed between the slot's write and its new index entry."""
    import subprocess
    import sys
    import textwrap

    from tests.helpers.store import load
    from tests.helpers.vllm_engine import ROOT

    child = textwrap.dedent("""
        import os, sys
        from kvtier import KVStore
        from kvtier.segment import cachedir
        from tests.helpers.kv import SMALL, make_kv
        from tests.helpers.store import config, seq
        store = KVStore(SMALL, config(sys.argv[1], host_chunks=4, disk_chunks=1))
        store.put(seq(0, 1), make_kv(seq(0, 1)))
        assert store.flush()
        cachedir.CacheDir.write_index = lambda self, *args: os._exit(9)  # kill -9 there
        store.put(seq(1000, 1), make_kv(seq(1000, 1)))
        store.flush()
        os._exit(1)
    """)
    assert subprocess.run([sys.executable, "-c", child, str(tmp_path)], cwd=ROOT,
                          timeout=120).returncode == 9
    k, cfg = seq(0, 1), config(tmp_path, host_chunks=4, disk_chunks=1)
    with KVStore(SMALL, cfg) as store:
        store.put(k, make_kv(k))
        assert store.flush()
    with KVStore(SMALL, cfg) as store:
        assert load(store, k)[0] == len(k)


def test_a_child_forked_by_a_writer_later_killed_does_not_keep_its_segment(tmp_path):
    """A child keeps its parent's descriptors across fork() (O_CLOEXEC covers exec only):
    a helper forked by a writer killed with kill -9 held the segment's lock, and the
    writer, started again, was kept out of its own segment (nothing recovered) for as long
    as the helper lived. A forked child now closes the lock. Found by a review."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    from tests.helpers.store import load
    from tests.helpers.vllm_engine import ROOT

    writer = textwrap.dedent("""
        import os, sys, time
        from kvtier import KVStore
        from tests.helpers.kv import SMALL, make_kv
        from tests.helpers.store import config, seq
        store = KVStore(SMALL, config(sys.argv[1]))
        store.put(seq(0, 1), make_kv(seq(0, 1)))
        assert store.flush()
        pid = os.fork()
        if pid == 0:  # a helper the application forks, nothing to do with kvtier
            open(os.path.join(sys.argv[1], "running"), "w").close()  # (past fork's handlers)
            time.sleep(60)
            os._exit(0)
        print(pid, flush=True)
        time.sleep(60)  # killed by the test
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    helper = int(proc.stdout.readline())
    deadline = time.monotonic() + 30
    while not (tmp_path / "running").exists():  # the child runs (on a busy machine, not
        assert time.monotonic() < deadline  # at once): the writer is killed after that
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    try:
        with KVStore(SMALL, config(tmp_path)) as store:
            assert not store.stats().paths_down
            assert load(store, seq(0, 1))[0] == len(seq(0, 1))
    finally:
        os.kill(helper, signal.SIGKILL)


def test_a_forked_child_keeps_the_lock_descriptor_number_on_dev_null(tmp_path):
    """The child's copy of the lock is dropped by making its number /dev/null, not by a
    close: closed, the number would go to the child's next open file, which the child's
    inherited store, closing, would close. The parent keeps its lock. Found by a review."""
    from kvtier.segment.lock import locked_here

    with KVStore(SMALL, config(tmp_path)) as store:
        directory = store.disk.paths.states[0].dir
        lock_fd = directory._lock_fd
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its lock descriptor is /dev/null now, its number taken
            os.close(read)
            seen = os.readlink(f"/proc/self/fd/{lock_fd}")
            other = os.open(os.devnull, os.O_RDONLY)
            os.write(write, f"{seen} {int(other != lock_fd)}".encode())
            os._exit(0)
        os.close(write)
        said = os.read(read, 200).decode()
        os.waitpid(pid, 0)
        os.close(read)
        assert said == "/dev/null 1", said
        assert locked_here(directory.dir) is True  # the parent still holds its lock


def test_a_path_taken_out_during_its_scan_gets_no_index_that_leaves_slots_out(tmp_path,
                                                                              monkeypatch):
    """Three headers unreadable in a row take the path out in the middle of its start-up
    scan: the index written from that scan named only what was read before, and the next
    start, on a healthy drive, trusted it: the slots never read were lost for good. No
    index is written then now, and the next start scans again. Found by a review."""
    from tests.helpers.disk_helpers import chunk, key, make_tier

    tier = make_tier([tmp_path], slots_per_path=8, o_direct=False)
    for i in range(8):
        assert tier.write(i, key(i), chunk(i).array).ok
    stride = tier.stride
    tier.close()
    (index,) = tmp_path.glob("*/writers/*/index.kvt")
    index.unlink()
    real = os.preadv

    def bad_sectors(fd, bufs, offset, *rest):  # slots 1-3 unreadable at this start
        if "slots-" in os.readlink(f"/proc/self/fd/{fd}") and offset in (stride, 2 * stride,
                                                                          3 * stride):
            raise OSError(errno.EIO, "bad sector")
        return real(fd, bufs, offset, *rest)

    monkeypatch.setattr(os, "preadv", bad_sectors)
    tier = make_tier([tmp_path], slots_per_path=8, o_direct=False)
    assert {r.slot for r in tier.recover(threads=1).slots} == {0}
    assert tier.down_paths  # taken out in the middle of the scan
    tier.close()
    monkeypatch.setattr(os, "preadv", real)
    tier = make_tier([tmp_path], slots_per_path=8, o_direct=False)
    assert {r.slot for r in tier.recover(threads=1).slots} == set(range(8))
    tier.close()
