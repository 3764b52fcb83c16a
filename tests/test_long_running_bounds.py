"""What a reader or writer that runs for weeks keeps stays bounded: nothing is remembered of
writers gone, a full disk leaves no temporary files behind, a segment that cannot be
reclaimed is said once and tried again once per lease_timeout, and a worker gives back the
space of reclaimed segments without reading from them."""

import errno
import logging
import os

import pytest

from kvtier import KVStore
from kvtier.io.safefs import SafeDir
from kvtier.segment.names import WRITERS_DIR
from kvtier.segment.seats import reclaim_segment
from kvtier.shared.view import SharedView
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.store import config, seq


def write_as(tmp_path, writer, start=0, **extra):
    """Write a chunk (of ``seq(start, 1)``) as ``writer``; return the store's namespace and
    chunk size."""
    with KVStore(SMALL, config(tmp_path, disk_chunks=8, share_writers=8, instance_id=writer,
                               share_refresh="off", **extra)) as store:
        tokens = seq(start, 1)
        store.put(tokens, make_kv(tokens))
        store.flush()
        return store.namespace, store.chunk_bytes


def test_a_reader_keeps_nothing_of_writers_whose_segments_are_gone(tmp_path):
    namespace, raw = write_as(tmp_path, "reader")
    view = SharedView([str(tmp_path)], namespace, raw, ("reader",), 120.0)
    for n in range(5):
        write_as(tmp_path, f"pod-{n}")  # a pod restarted under a new name, each time
        view.refresh()
        with SafeDir.open(tmp_path) as top, top.subdir(namespace.id) as ns_dir, \
                ns_dir.subdir(WRITERS_DIR) as writers:
            assert reclaim_segment(ns_dir, f"pod-{n}", writers.subdir(f"pod-{n}").inode())
        view.refresh()
    assert view._watch._seen == {} and view._upkeep._reclaim_after == {} and len(view) == 0
    view.close()


def test_a_gone_writers_chunks_leave_the_view_a_batch_at_a_time(tmp_path, monkeypatch):
    """Forgetting a writer of millions of slots (gone, or its log started over) holds the
    view's lock for ``APPLY_BATCH`` of them at a time: lookups get it in between."""
    import shutil
    import threading

    from kvtier.shared import view_logs

    monkeypatch.setattr(view_logs, "APPLY_BATCH", 2)
    with KVStore(SMALL, config(tmp_path, disk_chunks=32, share_writers=2, instance_id="pod",
                               share_refresh="off")) as store:
        store.put(seq(0, 5), make_kv(seq(0, 5)))
        store.flush()
        namespace, raw = store.namespace, store.chunk_bytes
    view = SharedView([str(tmp_path)], namespace, raw, ("reader",), 120.0)
    view.refresh()
    assert len(view) == 5
    held: list[int] = []

    class Counted:
        """The view's lock, each hold counted while the writer's chunks are dropped."""

        def __init__(self) -> None:
            self._lock = threading.Lock()

        def __enter__(self):
            self._lock.acquire()
            held.append(len(view._index))

        def __exit__(self, *exc):
            self._lock.release()

    (segment,) = tmp_path.glob("*/writers/pod")
    shutil.rmtree(segment)
    view._lock = Counted()
    view.refresh()
    drops = held.index(3) - 1  # the holds from the first drop on: 2 chunks a hold
    assert len(view) == 0 and held[drops:drops + 4] == [5, 3, 1, 0]
    view.close()


def test_a_reader_follows_no_more_slots_than_the_directory_holds(tmp_path, caplog):
    """Writers whose logs name more chunks than the directory holds (files kvtier did not
    write, or an engine given a larger disk_capacity): the reader follows at most the
    directory's slots a path, over every writer, says so once, and reads the rest as misses."""
    for n in range(3):
        namespace, raw = write_as(tmp_path, f"pod-{n}", start=n)
    view = SharedView([str(tmp_path)], namespace, raw, ("reader",), 120.0, max_slots=2)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        view.refresh()
        view.refresh()
    assert len(view) == 2 and view.passed_over == 1
    assert sum(state.chunks for state in view.writers()) == 2
    assert sum("more chunks than the shared directory holds" in r.getMessage()
               for r in caplog.records) == 1
    view.close()


@pytest.mark.parametrize("call", ["write", "rename"])
def test_a_replace_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch, call):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with SafeDir.open(tmp_path) as directory:
        directory.replace_file("lease", b"old")
        monkeypatch.setattr(os, call, full)
        for _ in range(3):
            with pytest.raises(OSError, match="No space"):
                directory.replace_file("lease", b"new")
        monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["lease"] and (tmp_path / "lease").read_bytes() == b"old"


def test_a_segment_that_cannot_be_reclaimed_is_said_once_and_tried_once_per_timeout(
        tmp_path, caplog, monkeypatch):
    from kvtier.shared import upkeep
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    namespace, raw = write_as(tmp_path, "gone", lease_timeout="2s")
    (slot_file,) = tmp_path.glob("*/writers/gone/slots-*.kvt")
    os.chown(slot_file, 65534, 65534)  # another user's file: kvtier never deletes it
    tries = []
    real = upkeep.reclaim_segment
    monkeypatch.setattr(upkeep, "reclaim_segment", lambda *args: tries.append(1) or real(*args))
    now = [0.0]  # the reader's clock, moved by hand
    view = SharedView([str(tmp_path)], namespace, raw, ("reader",), 2.0, clock=lambda: now[0])
    view.refresh()  # first seen
    now[0] += 2.1  # its lease stood still for the timeout: gone
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for _ in range(20):
            view.refresh()
    assert len(tries) == 1 and slot_file.exists()
    said = [r for r in caplog.records if "could not reclaim" in r.getMessage()]
    assert len(said) == 1 and "slots-0000.kvt" in said[0].getMessage()
    now[0] += 2.1
    view.refresh()
    assert len(tries) == 2  # tried again after lease_timeout
    view.close()


def test_each_engine_step_gives_back_the_space_of_reclaimed_segments(tmp_path, monkeypatch):
    from kvtier.connector.common.messages import StepPlan
    from tests.helpers.worker_side import worker

    side, _ = worker(tmp_path)
    sweeps = []
    monkeypatch.setattr(side._other_reads.kept, "sweep_soon", lambda: sweeps.append(1))
    side.save(StepPlan())
    side.save(StepPlan())
    assert len(sweeps) == 2
    side.close()


def test_a_step_never_waits_on_a_kept_file_of_a_dead_shared_mount(tmp_path, monkeypatch):
    """The sweep of other writers' kept files runs off the step, and looks at each file
    outside the reader's lock: an ``fstat`` a dead network server never answers holds
    neither the engine's step nor a read."""
    import threading

    from kvtier.connector.common.messages import StepPlan
    from tests.helpers.worker_side import worker

    side, _ = worker(tmp_path)
    reads = side._other_reads
    other = tmp_path / "other-writer-slots-0"
    other.write_bytes(b"\0" * 4096)
    fd = os.open(other, os.O_RDONLY)
    reads.kept._fds[(0, "other", 0)] = (fd, 1)  # a file of another writer's segment, kept open
    reads.kept._swept = 0.0  # the last sweep was long ago
    real_fstat, release = os.fstat, threading.Event()

    def dead_server(target, *args, **kwargs):
        if target == fd:
            release.wait(20)
        return real_fstat(target, *args, **kwargs)

    monkeypatch.setattr(os, "fstat", dead_server)
    done = threading.Event()
    threading.Thread(target=lambda: (side.save(StepPlan()), done.set()), daemon=True).start()
    try:
        assert done.wait(5), "the engine's step waited on fstat of a shared segment's file"
        assert reads.kept._lock.acquire(timeout=5), "the sweep held the reader's lock"
        reads.kept._lock.release()
    finally:
        release.set()
    side.close()


def test_a_read_never_waits_on_a_kept_file_of_another_paths_dead_mount(tmp_path, monkeypatch):
    """Reads start the sweep of kept files on a thread of its own: a file of path 0 kept
    open on a mount whose server stopped answering holds no read of path 1."""
    import threading

    import numpy as np

    from kvtier.keys import Namespace
    from kvtier.shared import kept_files
    from kvtier.shared.reads import OtherReads, SlotRef

    ns = Namespace(model="m", kv_dtype="bf16", layout="x", block_tokens=16, chunk_tokens=16)
    roots = [tmp_path / "p0", tmp_path / "p1"]
    for root in roots:
        (root / ns.id / WRITERS_DIR / "w").mkdir(parents=True, mode=0o700)
        (root / ns.id / WRITERS_DIR / "w" / "slots-0000.kvt").write_bytes(bytes(1 << 16))
    raw = 4096
    reads = OtherReads([str(r) for r in roots], ns, raw, 4096 + raw, [False, False])
    into = np.zeros(raw + 4096, np.uint8)
    reads.read(SlotRef("w", 0, 0, b"\0" * 16, 0, raw, 1), into)  # path 0's file kept open
    dead, real, release = reads.kept._fds[(0, "w", 0)][0], kept_files._unlinked, threading.Event()

    def unlinked(fd):
        if fd == dead:
            release.wait(20)  # path 0's server stopped answering
        return real(fd)

    monkeypatch.setattr(kept_files, "_unlinked", unlinked)
    reads.kept._swept -= kept_files.SWEEP_S + 1  # the next read is due to sweep
    done = threading.Event()
    threading.Thread(target=lambda: (reads.read(SlotRef("w", 1, 0, b"\0" * 16, 0, raw, 1), into),
                                     done.set()), daemon=True).start()
    try:
        assert done.wait(5), "a read of path 1 waited on fstat of path 0's kept file"
    finally:
        release.set()


def test_a_listener_gets_what_the_view_holds_without_holding_up_lookups(tmp_path, monkeypatch):
    """(with KV events on, ``listen`` takes every chunk followed: made into chunks under the
    view's lock, a million of them held a step's lookup for seconds)"""
    from kvtier.keys import ChunkKey, Namespace
    from kvtier.shared import view as view_module
    from kvtier.shared.chunk_index import Copy

    ns = Namespace(model="m", kv_dtype="bf16", layout="x", block_tokens=16, chunk_tokens=16)
    view = SharedView([str(tmp_path)], ns, 4096, ("me",), 120.0)

    class Segment:  # a followed segment, as far as the view's chunks name it
        writer, path = "w", 0

    view._sources[0] = Segment()
    for i in range(3):
        view._index.put(ChunkKey(i.to_bytes(16, "little")), Copy(0, i, 0, 4096))
    real, locked = view_module.unpack, []
    monkeypatch.setattr(view_module, "unpack",
                        lambda packed: (locked.append(view._lock.locked()), real(packed))[1])
    chunks = view.listen(lambda key, chunk: None)
    assert sorted(c.slot for c in chunks) == [0, 1, 2] and locked == [False] * 3
    view.close()
