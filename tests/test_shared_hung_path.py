"""A path of a shared directory whose mount answers its statistics and the open of its top
directory, then holds every call below it (a FUSE daemon whose back end hung): the shared
view's refresh waits for that path's look once, bounded, then passes it over while the look
runs on, and goes on following the writers of the other paths. Before, the refresh thread
stayed held in the listing of that path for good, and the chunks other engines wrote after
it were never found."""

import threading

import pytest

from kvtier.io import bounded_jobs, root_looks
from kvtier.shared.followed import Followed
from kvtier.shared.view import SharedView
from tests.helpers.cowriter import entry, write_log
from tests.helpers.disk_helpers import NS, RAW, key, wait_until
from tests.helpers.hung_mount import fuse_dirs, unshared

SCRIPT = """
import json, sys, time
from kvtier import KVStore
from kvtier.io import answers, bounded_jobs
from tests.helpers.hung_mount import StatfsOnly
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.shared import shared
from tests.helpers.store import exact, seq

answers.MIN_WAIT_S, bounded_jobs.PATH_JOB_MIN_S, bounded_jobs.PATH_JOB_TIMES = 1.0, 2.0, 1
stuck, good = sys.argv[1], sys.argv[2]
mount, out = StatfsOnly(stuck, top=True), {}
cfg = {"disk_paths": [stuck, good], "load_timeout": "1s", "disk_retry": "1h"}
reader = KVStore(SMALL, {**shared(good, "reader"), **cfg})
writer = KVStore(SMALL, {**shared(good, "writer"), **cfg})
tokens = seq(0, 4)
writer.put(tokens, make_kv(tokens))
out["flushed"] = bool(writer.flush(timeout=30))
deadline = time.monotonic() + 30
while time.monotonic() < deadline and reader.lookup(tokens).tokens < len(tokens):
    time.sleep(0.1)
out["found"] = reader.lookup(tokens).tokens
out["served"] = exact(reader, tokens) if out["found"] else 0
out["statfs"] = mount.statfs
mount.release()  # the calls held fail
writer.close()
reader.close()
print(json.dumps(out))
"""


def test_a_path_that_hangs_below_its_top_directory_holds_no_shared_view_for_good(tmp_path):
    good, stuck = fuse_dirs(tmp_path)
    out = unshared(SCRIPT, str(stuck), str(good), timeout=150)
    assert out["flushed"]
    assert out["statfs"] >= 1, "the path never answered its statistics: not the case tested"
    assert out["found"] == out["served"] == 4 * 16, out


@pytest.fixture
def short_wait(monkeypatch):
    monkeypatch.setattr(bounded_jobs, "PATH_JOB_TIMES", 0)
    monkeypatch.setattr(bounded_jobs, "PATH_JOB_MIN_S", 0.5)


def two_roots(tmp_path) -> list[str]:
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        root.mkdir(mode=0o700)
        write_log(root, "w1", [(0, entry(0)), (1, entry(1))])
    return [str(root) for root in roots]


def held_listing(view: SharedView, release: threading.Event) -> threading.Event:
    """Path 0's listing held until ``release``: a mount that answered its top directory."""
    real, held = view._listing.names, threading.Event()

    def names(path, own):
        if path == 0:
            held.set()
            release.wait(30)
        return real(path, own)
    view._listing.names = names
    return held


def test_a_slow_look_passes_its_path_over_for_its_own_kind_only(tmp_path, short_wait):
    """A look past its wait may only be slow (many writers on a slow mount): later refreshes
    pass the path over while it runs, the store's own opens and tries do not."""
    roots = two_roots(tmp_path)
    view = SharedView(roots, NS, RAW, (None, None), 120.0)
    release = threading.Event()
    held = held_listing(view, release)
    view.refresh()
    assert held.is_set() and view.find(key(0)) is not None  # path 1's copy, followed
    assert roots[0] in root_looks.under_way(view._kind) and not root_looks.stuck(roots[0])
    release.set()
    wait_until(lambda: not root_looks.under_way(view._kind), "the slow look to end")
    view.refresh()
    assert {chunk.path for chunk in view.copies(key(0))} == {0, 1}
    assert view.close()


def test_a_path_whose_look_still_runs_keeps_its_files_open_at_close(tmp_path, short_wait,
                                                                    monkeypatch):
    """Closing a file on a hung FUSE mount waits for it (FLUSH): the files of a path whose
    look still runs are left to the process's exit, and close says so."""
    roots = two_roots(tmp_path)
    view = SharedView(roots, NS, RAW, (None, None), 120.0)
    view.refresh()  # both paths followed: their log files open
    release = threading.Event()
    held = held_listing(view, release)
    view.refresh()  # path 0 passed over after the wait
    assert held.is_set()
    closed, real_close = [], Followed.close
    monkeypatch.setattr(Followed, "close", lambda self: (closed.append(self.path), real_close(self)))
    try:
        assert view.close() is False
        assert closed == [1]
    finally:
        release.set()
