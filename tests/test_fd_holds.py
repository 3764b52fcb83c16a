"""A segment's files are closed only once no I/O holds them: a read (or write) that fetched a
descriptor before its path went out of service and came back keeps the file it fetched to its
last system call, so the number never goes to a file opened meanwhile."""

import errno
import os
import threading
import time

import numpy as np
import pytest

from kvtier.disk import reads
from kvtier.io.buffers import AlignedBuffer
from kvtier.segment.holds import Holds
from tests.helpers.disk_helpers import RAW, chunk, key, make_tier


def test_holds_release_once_when_closed_and_free():
    released = []
    holds = Holds("d", lambda: released.append(1))
    with holds.held():
        with holds.held():  # holds nest
            holds.close()
            assert holds.closed and not released
        assert not released
    assert released == [1]
    holds.close()
    assert released == [1]  # once
    with pytest.raises(OSError) as refused, holds.held():
        pass
    assert refused.value.errno == errno.EBADF and "d was closed" in str(refused.value)


def test_holds_free_at_close_release_at_once():
    released = []
    holds = Holds("d", lambda: released.append(1))
    with holds.held():
        pass
    holds.close()
    assert released == [1]


def test_a_read_under_way_when_its_path_comes_back_keeps_the_file_it_fetched(tmp_path, monkeypatch):
    disk = make_tier([tmp_path], retry=0.001)
    data = chunk(5)
    assert disk.write(2, key(5), data.array).ok
    path, real = disk.paths[0], reads.read_fully
    old = path.dir
    fetched, go, seen = threading.Event(), threading.Event(), {}

    def slow_read(fd, iov, offset):  # the thread is slow between fetching and reading
        seen["inode"] = os.fstat(fd).st_ino
        fetched.set()
        go.wait(10)
        seen["after"] = os.fstat(fd).st_ino  # the file whose number it fetched: still it
        return real(fd, iov, offset)

    monkeypatch.setattr(reads, "read_fully", slow_read)
    out, result = AlignedBuffer(RAW, pin=False), []
    reader = threading.Thread(target=lambda: result.append(disk.read(2, key(5), out.array)))
    reader.start()
    assert fetched.wait(10)
    disk.paths.take_down(path, "test")
    time.sleep(0.01)
    assert disk.revive(0) and path.dir is not old
    others = [os.open(tmp_path / f"other-{i}", os.O_CREAT | os.O_RDWR, 0o600) for i in range(32)]
    try:
        assert old.closed and old._fds  # the read holds them open, and it has not ended
        go.set()
        reader.join(10)
        assert seen["after"] == seen["inode"]
        assert result[0].ok and np.array_equal(out.array[:RAW], data.array[:RAW])
        assert not old._fds and old.index_fd == -1  # closed once the read ended
    finally:
        go.set()
        for fd in others:
            os.close(fd)
        disk.close()


def test_a_close_that_fails_closes_every_other_file_and_raises_nothing(tmp_path, monkeypatch):
    from kvtier.segment import log_writer

    disk = make_tier([tmp_path])
    assert disk.write(2, key(5), chunk(5).array).ok
    directory = disk.paths[0].dir

    def eio(self):
        raise OSError(errno.EIO, "close: write-back failed")

    monkeypatch.setattr(log_writer.SegmentLog, "close", eio)
    directory.close()  # a network filesystem's close reporting a failed write-back
    assert not directory._fds and directory.index_fd == -1 and directory.dir.fd == -1
    disk.close()
