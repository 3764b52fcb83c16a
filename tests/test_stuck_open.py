"""A disk path whose file system answered, then stopped answering in the middle of its open
(its lock, lease, seat, O_DIRECT probe) holds no start: the open is waited for
``path_job_wait(load_timeout)`` (``kvtier/disk/path_opener.py``), the path starts out of
service, and what the open left behind opens later is closed, so that the path's next try
opens it again. A real mount that answers its statistics and nothing else is
tests/test_hung_disk_path.py's."""

import logging
import threading
import time

import pytest

from kvtier import KVStore
from kvtier.disk.opening import OpenArgs
from kvtier.io import bounded_jobs, root_looks
from tests.helpers.disk_helpers import wait_until
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.store import config, exact, seq

WAIT_S = 2.0  # a path job's wait here: a healthy open ends well within it on a loaded machine


class StuckOpen:
    """``OpenArgs.open`` of ``root`` held until ``release`` is set, once; what it opened
    then is kept in ``late``."""

    def __init__(self, root: str) -> None:
        self.root, self.release = root, threading.Event()
        self.held, self.late = threading.Event(), []
        self.armed, self.calls = True, 0

    def open(self, real, args, root, writer):
        if root != self.root or self.held.is_set() or not self.armed:
            return real(args, root, writer)
        self.calls += 1
        self.held.set()
        self.release.wait(30)
        opened = real(args, root, writer)
        self.late.append(opened[0])
        return opened


@pytest.fixture
def stuck_b(tmp_path, monkeypatch):
    stuck, real = StuckOpen(str(tmp_path / "b")), OpenArgs.open
    monkeypatch.setattr(OpenArgs, "open", lambda args, root, writer: stuck.open(real, args, root, writer))
    monkeypatch.setattr(bounded_jobs, "PATH_JOB_TIMES", 0)
    monkeypatch.setattr(bounded_jobs, "PATH_JOB_MIN_S", WAIT_S)
    yield stuck
    stuck.release.set()


def two_paths(tmp_path) -> dict:
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        root.mkdir()
    return {**config(tmp_path, host_chunks=2), "disk_paths": [str(r) for r in roots]}


def test_a_path_whose_open_hangs_starts_out_and_its_late_open_is_closed(tmp_path, stuck_b):
    cfg = two_paths(tmp_path)
    with KVStore(SMALL, {**cfg, "disk_retry": "1h"}) as store:  # before: the start was held
        assert stuck_b.held.is_set()
        reason = store.stats().paths_down[stuck_b.root]
        assert f"cannot open: no end to it within {WAIT_S:g} s" in reason, reason
        tokens = seq(0, 4)
        store.put(tokens, make_kv(tokens))
        assert store.flush() and exact(store, tokens) == 4 * CHUNK  # path a serves
        writer = store.disk.writer
        stuck_b.release.set()
        wait_until(lambda: stuck_b.late and stuck_b.late[0].closed, "the late open to be closed")
        store.disk.paths[1].retry_at = 0.0  # tried now

        def back() -> bool:
            store.lookup(seq(90_000, 1))  # each call polls the tries due
            return store.stats().paths_back >= 1
        wait_until(back, "the path never came back once its open ended")
        assert store.disk.writer == writer and store.disk.paths[1].own == writer
        more = seq(1000, 8)
        store.put(more, make_kv(more))
        assert store.flush() and exact(store, more) == 8 * CHUNK


def test_a_path_whose_open_hangs_holds_no_other_paths_open(tmp_path, stuck_b):
    """The first path hung: the second still opens, under the first writer id free."""
    cfg = two_paths(tmp_path)
    stuck_b.root = str(tmp_path / "a")
    with KVStore(SMALL, cfg) as store:
        assert list(store.stats().paths_down) == [stuck_b.root]
        assert store.disk.paths[1].own == store.disk.writer
        tokens = seq(0, 4)
        store.put(tokens, make_kv(tokens))
        assert store.flush() and exact(store, tokens) == 4 * CHUNK


def test_a_try_whose_open_hangs_gives_up_and_the_next_starts_none_beside_it(tmp_path, stuck_b,
                                                                           caplog):
    """At a try of a path out of service (on its own I/O queue) the open is bounded the
    same way; while it runs on, a later try does not open the path again beside it."""
    cfg = two_paths(tmp_path)
    stuck_b.armed = False
    caplog.set_level(logging.DEBUG, "kvtier.disk.tier")
    with KVStore(SMALL, {**cfg, "disk_retry": "1h"}) as store:
        paths = store.disk.paths
        paths.take_down(paths[1], "taken out by the test")
        stuck_b.armed = True

        def tried() -> bool:
            paths[1].retry_at = 0.0
            store.lookup(seq(90_000, 1))  # each call polls the tries due
            return stuck_b.held.is_set()
        wait_until(tried, "the path to be tried")
        def refused() -> bool:  # tried again and again, past the wait, while the open runs on
            paths[1].retry_at = 0.0
            store.lookup(seq(90_000, 1))
            time.sleep(0.1)
            return "an earlier open or look of it has not ended" in caplog.text  # the first gave up
        wait_until(refused, "a later try to pass the path over while its open ran on")
        assert stuck_b.calls == 1 and store.stats().paths_back == 0
        stuck_b.release.set()
        wait_until(lambda: stuck_b.late and stuck_b.late[0].closed, "the late open to be closed")

        def back() -> bool:
            paths[1].retry_at = 0.0
            store.lookup(seq(90_000, 1))
            return store.stats().paths_back >= 1
        wait_until(back, "the path never came back once its open ended")


def test_a_look_for_the_workers_id_that_does_not_end_leaves_the_id_unknown(tmp_path, monkeypatch):
    """The scheduler side takes the first default id for its workers' only when no process
    of this host holds it on any path: a path whose look did not end may hold it, so the
    id stays unknown (None: no segment is taken for its own), and the path's look still
    under way is not started again beside it."""
    from kvtier.config.settings import load_config
    from kvtier.connector.common import engine_writer
    from tests.helpers.worker_side import GEO

    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        root.mkdir()
    release, real, looks = threading.Event(), engine_writer._held_at, []

    def held_at(root, *args):
        looks.append(root)
        if root == str(roots[1]):
            release.wait(30)
        return real(root, *args)

    monkeypatch.setattr(engine_writer, "_held_at", held_at)
    monkeypatch.setattr(bounded_jobs, "PATH_JOB_TIMES", 0)
    monkeypatch.setattr(bounded_jobs, "PATH_JOB_MIN_S", WAIT_S)
    cfg = load_config({"disk_paths": [str(r) for r in roots], "chunk_tokens": 32}, environ={})
    namespace = GEO.namespace("m", "", 1, 0)
    try:
        assert engine_writer.engine_writers(cfg, [namespace]) == [None]
        assert engine_writer.engine_writers(cfg, [namespace]) == [None]
        assert looks.count(str(roots[1])) == 1
    finally:
        release.set()
    wait_until(lambda: not root_looks.under_way("kvtier-writers-look"), "the held look to end")
    assert engine_writer.engine_writers(cfg, [namespace]) == [engine_writer.writer_ids(None)[0]]


def test_paths_after_the_first_that_opened_are_opened_at_once(tmp_path, monkeypatch):
    """The writer id known from the first path that opened, the others are opened together,
    each bounded: two paths whose opens hang cost the start one wait, not two."""
    from kvtier.disk import path_opener

    roots = [tmp_path / name for name in "abc"]
    for root in roots:
        root.mkdir()
    release, real_open, real_look, looks = threading.Event(), OpenArgs.open, path_opener.look_at_roots, []

    def hung(args, root, writer):
        if root != str(roots[0]):
            release.wait(30)
        return real_open(args, root, writer)

    monkeypatch.setattr(OpenArgs, "open", hung)
    monkeypatch.setattr(path_opener, "look_at_roots",
                        lambda at, *rest, **kw: looks.append(list(at)) or real_look(at, *rest, **kw))
    monkeypatch.setattr(bounded_jobs, "PATH_JOB_TIMES", 0)
    monkeypatch.setattr(bounded_jobs, "PATH_JOB_MIN_S", WAIT_S)
    cfg = {**config(tmp_path, host_chunks=2), "disk_paths": [str(r) for r in roots]}
    try:
        with KVStore(SMALL, cfg) as store:
            down = store.stats().paths_down
            assert sorted(down) == [str(roots[1]), str(roots[2])]
            assert all(f"no end to it within {WAIT_S:g} s" in reason for reason in down.values())
            assert looks[:2] == [[str(roots[0])], [str(roots[1]), str(roots[2])]]
    finally:
        release.set()


def test_a_bug_in_one_paths_open_closes_what_the_others_opened(tmp_path, monkeypatch):
    """Not an OSError (a bug): the start fails with it, as before, and the segments the
    other paths opened beside it are closed (their locks let go)."""
    roots = [tmp_path / name for name in "abc"]
    for root in roots:
        root.mkdir()
    opened, real = [], OpenArgs.open

    def open_(args, root, writer):
        if root == str(roots[1]):
            raise ValueError("a bug in b's open")
        got = real(args, root, writer)
        opened.append(got[0])
        return got

    monkeypatch.setattr(OpenArgs, "open", open_)
    with pytest.raises(ValueError, match="a bug"):
        KVStore(SMALL, {**config(tmp_path, host_chunks=2), "disk_paths": [str(r) for r in roots]})
    assert len(opened) == 2 and all(directory.closed for directory in opened)
