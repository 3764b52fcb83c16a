"""What a power loss or a kernel crash after ``flush()`` or a clean close leaves of a segment:
its slot files, then its index, are made durable (``fdatasync``), so that the index a restart
adopts without reading the slots is the one the store last wrote, and names no slot the
device never got. What reaches the disk is modelled by the syncs: a file holds, after a
power loss, what it held when it was last synced."""

import errno
import fcntl
import json
import logging
import os
from pathlib import Path

import pytest

from kvtier import KVStore
from tests.helpers.disk_helpers import wait_until
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.store import config, exact, seq


class Disk:
    """Every ``fdatasync``: the order files were synced in (by inode) and, for files opened
    without ``O_DIRECT``, their bytes at their last sync; ``fail(inode)`` makes one fail."""

    def __init__(self, monkeypatch, fail=lambda inode: False):
        self.order: list[int] = []
        self.synced: dict[int, bytes] = {}
        self.fail = fail
        real = os.fdatasync

        def fdatasync(fd):
            info = os.fstat(fd)
            if self.fail(info.st_ino):
                raise OSError(errno.EIO, "Input/output error")
            real(fd)
            self.order.append(info.st_ino)
            if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                self.synced[info.st_ino] = os.pread(fd, info.st_size, 0)

        monkeypatch.setattr(os, "fdatasync", fdatasync)

    def holds(self, path) -> bytes | None:
        """What ``path`` would hold after a power loss now (None: never synced)."""
        return self.synced.get(path.stat().st_ino)

    def last_sync(self, path) -> int:
        inode = path.stat().st_ino
        return max((i for i, synced in enumerate(self.order) if synced == inode), default=-1)


def _segment(root, store):
    return root / store.namespace.id / "writers" / store.disk.writer


def test_flush_leaves_on_disk_the_index_the_store_wrote_after_its_slots(tmp_path, monkeypatch):
    disk = Disk(monkeypatch)
    tokens = seq(0, 6)
    with KVStore(SMALL, config(tmp_path)) as store:
        store.put(tokens, make_kv(tokens))
        assert store.flush()
        segment = _segment(tmp_path, store)
        index = segment / "index.kvt"
        assert disk.holds(index) == index.read_bytes() != b""
        slot_files = sorted(segment.glob("slots-*.kvt"))
        assert slot_files and all(0 <= disk.last_sync(f) < disk.last_sync(index)
                                  for f in slot_files)


def test_a_clean_close_leaves_on_disk_the_index_the_store_wrote(tmp_path, monkeypatch):
    disk = Disk(monkeypatch)
    tokens = seq(0, 6)
    with KVStore(SMALL, config(tmp_path)) as store:
        store.put(tokens, make_kv(tokens))  # written through in the background: no flush
        segment = _segment(tmp_path, store)
    index = segment / "index.kvt"
    assert disk.holds(index) == index.read_bytes() != b""
    with KVStore(SMALL, config(tmp_path)) as store:
        assert store.stats().recovered_chunks == 6


def test_a_write_over_after_its_paths_sync_began_is_not_vouched_for(tmp_path, monkeypatch):
    """A chunk put while a flush syncs, its write over after its path's sync began and before
    the flush counts what is not on disk: no sync covered it (a power loss would lose its
    index entry), so it counts as not written, where it counted as on disk and the flush was
    true. The next flush's sync covers it."""
    from kvtier.store import flush as flush_module

    disk = Disk(monkeypatch)
    first, late = seq(0, 2), seq(100, 1)
    with KVStore(SMALL, config(tmp_path)) as store:
        store.put(first, make_kv(first))
        real = flush_module.Flusher._sync

        def a_write_ends_after_the_sync(self, *args):
            synced = real(self, *args)
            store.put(late, make_kv(late))
            assert store._state.lane.drain()  # its write over: on disk, in the index
            return synced

        monkeypatch.setattr(flush_module.Flusher, "_sync", a_write_ends_after_the_sync)
        result = store.flush()
        monkeypatch.setattr(flush_module.Flusher, "_sync", real)
        index = _segment(tmp_path, store) / "index.kvt"
        assert store.stats().disk_writes == 3 and disk.holds(index) != index.read_bytes()
        assert not result and result.not_written == 1 and not result.not_synced, result
        assert store.flush() and disk.holds(index) == index.read_bytes()


@pytest.mark.parametrize("failing", ["slots-0000.kvt", "index.kvt"])
def test_a_sync_that_fails_makes_flush_false_and_takes_the_path_out(tmp_path, monkeypatch,
                                                                    failing):
    """(after a failed sync, the kernel has marked the lost pages clean: a second flush's
    sync would succeed and vouch for chunks that are not on the disk)"""
    tokens = seq(0, 2)
    with KVStore(SMALL, config(tmp_path, disk_retry="off")) as store:
        store.put(tokens, make_kv(tokens))
        assert store.flush()
        file = _segment(tmp_path, store) / failing
        disk = Disk(monkeypatch, fail=lambda inode: inode == file.stat().st_ino)
        more = seq(100, 2)
        store.put(more, make_kv(more))
        result = store.flush()
        assert not result and result.not_synced == 1 and result.not_written == 4, result
        assert "a sync failed" in store.stats().paths_down[str(tmp_path)]
        disk.fail = lambda inode: False  # the next sync succeeds, as Linux's would
        result = store.flush()  # the chunks held in memory have no disk copy now
        assert not result and result.not_written == 4, result
        assert exact(store, more) == 2 * CHUNK  # served from host memory all the same


def test_a_path_a_failed_sync_took_out_comes_back_empty_and_a_flush_writes_again(tmp_path,
                                                                              monkeypatch):
    tokens = seq(0, 2)
    with KVStore(SMALL, config(tmp_path, disk_retry="0.05s")) as store:
        index = _segment(tmp_path, store) / "index.kvt"
        disk = Disk(monkeypatch, fail=lambda inode: inode == index.stat().st_ino)
        store.put(tokens, make_kv(tokens))
        assert not store.flush()
        disk.fail = lambda inode: False
        wait_until(lambda: bool(store.flush()), "no flush was true once the path came back")
        stats = store.stats()
        assert stats.paths_back == 1 and not stats.paths_down and stats.disk_writes == 4
        assert disk.holds(index) == index.read_bytes()  # naming the chunks written again
        assert exact(store, tokens) == 2 * CHUNK


def test_a_sync_that_fails_at_close_takes_the_path_out_and_the_close_goes_on(tmp_path,
                                                                            monkeypatch, caplog):
    tokens = seq(0, 2)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        store = KVStore(SMALL, config(tmp_path))
        index = _segment(tmp_path, store) / "index.kvt"
        Disk(monkeypatch, fail=lambda inode: inode == index.stat().st_ino)
        store.put(tokens, make_kv(tokens))  # written through in the background: no flush
        assert store.close()
    assert "out of service" in caplog.text and "a sync failed" in caplog.text
    leases = list(tmp_path.glob("*/writers/*/lease"))
    assert len(leases) == 1 and json.loads(leases[0].read_text())["closed_ns"]


def test_a_filesystem_that_syncs_no_file_keeps_its_path_and_flush_is_false(tmp_path, monkeypatch):
    with KVStore(SMALL, config(tmp_path, disk_retry="off")) as store:
        store.put(seq(0, 2), make_kv(seq(0, 2)))

        def unsupported(fd):
            raise OSError(errno.ENOSYS, "Function not implemented")

        monkeypatch.setattr(os, "fdatasync", unsupported)
        for _ in range(4):  # never taken out for it, nor counted as I/O errors against it
            result = store.flush()
            assert not result and result.not_synced == 1 and result.not_written == 0, result
        monkeypatch.undo()
        assert not store.stats().paths_down and store.flush()


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC])
def test_a_sync_failing_on_a_read_only_or_full_filesystem_makes_flush_false(tmp_path,
                                                                           monkeypatch, err):
    with KVStore(SMALL, config(tmp_path, disk_retry="off")) as store:
        store.put(seq(0, 2), make_kv(seq(0, 2)))

        def failing(fd):
            raise OSError(err, os.strerror(err))

        monkeypatch.setattr(os, "fdatasync", failing)
        result = store.flush()
        monkeypatch.undo()
        assert not result and result.not_synced == 1, result


def test_a_slow_sync_at_close_holds_up_neither_the_close_nor_the_other_paths(tmp_path, monkeypatch):
    """A slow (not hung) sync on one path: past half its budget the close goes on, every
    lease says its segment closed, and the slow path's files close once its sync ends."""
    import glob
    import json
    import os
    import time

    from kvtier import KVStore
    from kvtier.segment import slot_files
    from tests.helpers.kv import SMALL, make_kv
    from tests.helpers.store import config, seq

    slow_root, fast_root = tmp_path / "a", tmp_path / "b"
    slow_root.mkdir()
    fast_root.mkdir()
    real = os.fdatasync

    def slow(fd):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(slow_root)):
            time.sleep(4)  # a slow device, a large dirty page cache on NFS
        real(fd)

    cfg = config(str(slow_root), o_direct=False)
    cfg["disk_paths"] = [str(slow_root), str(fast_root)]
    store = KVStore(SMALL, cfg)
    tokens = seq(0, 6)
    store.put(tokens, make_kv(tokens))
    assert store.flush(timeout=30)
    monkeypatch.setattr(slot_files.os, "fdatasync", slow)
    start = time.monotonic()
    assert store.close(timeout=1.0)
    assert time.monotonic() - start < 3.5
    leases = [json.loads(Path(p).read_text()) for root in (slow_root, fast_root)
              for p in glob.glob(f"{root}/*/writers/*/lease")]
    assert len(leases) == 2 and all(lease["closed_ns"] for lease in leases)


def test_a_sync_racing_its_paths_take_down_counts_as_the_path_down_not_a_failure(tmp_path):
    from kvtier.disk.durable import sync_path
    from kvtier.io.result import IOStatus
    from tests.helpers.disk_helpers import make_tier

    disk = make_tier([tmp_path])
    paths, path = disk.paths, disk.paths[0]
    directory = path.dir

    def taken_down_meanwhile():
        paths.take_down(path, "test")
        directory.close()
        raise OSError(errno.EBADF, f"{directory.path} was closed")

    directory.sync = taken_down_meanwhile
    result = sync_path(paths, 0)
    assert result.status is IOStatus.PATH_DOWN and path.eio_run == 0
    disk.close()


def test_a_new_segments_directories_are_synced_as_it_opens(tmp_path, monkeypatch):
    """Its name in writers/, the namespace's in the root: a power loss does not lose the
    segment whose files flush made durable."""
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or real(fd))
    with KVStore(SMALL, config(tmp_path)) as store:
        segment = _segment(tmp_path, store)
    assert {tmp_path.stat().st_ino, segment.parent.stat().st_ino,
            segment.parent.parent.stat().st_ino} <= set(synced)
