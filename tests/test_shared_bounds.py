"""What a reader pays for a co-writer's segment that is large or hostile stays bounded: many
copies of one chunk are forgotten in proportion to their number, a chunk followed costs a few
hundred bytes, empty directories never hide a real writer, a log of zeros costs a record or
two a refresh, and one refresh reads a bounded share of what was appended."""

import os
import shutil
import sys
from pathlib import Path

import pytest

import kvtier
from kvtier.segment.log import RECORD_BYTES
from kvtier.segment.names import LOG_FILE, WRITERS_DIR
from kvtier.shared import view as view_module
from kvtier.shared import view_logs
from kvtier.shared.view import SharedView
from tests.helpers.cowriter import entry, segment, write_log
from tests.helpers.disk_helpers import NS, RAW, key

KVTIER_CODE = str(Path(kvtier.__file__).parent)


def reader(root, **extra) -> SharedView:
    return SharedView([str(root)], NS, RAW, ("reader",), 120.0, **extra)


def kvtier_lines(step) -> int:
    """The lines of kvtier's code that ``step()`` runs (loop iterations included): a count
    of operations that no timing sways."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    sys.settrace(lambda frame, event, arg:
                 local if frame.f_code.co_filename.startswith(KVTIER_CODE) else None)
    try:
        step()
    finally:
        sys.settrace(None)
    return count


def forgetting_copies(root, n: int, how: str) -> int:
    """Operations of the refresh that forgets ``n`` copies of one chunk: a co-writer's log
    names ``n`` slots that all repeat one entry, then starts a new, empty log (a restart) or
    its segment is deleted."""
    writer = f"copies-{n}"
    root.mkdir(mode=0o700)
    write_log(root, writer, [(slot, entry(0)) for slot in range(n)])
    view = reader(root)
    view.refresh()
    assert view.find(key(0)) is not None and view.writers()[-1].chunks == n
    if how == "restart":
        write_log(root, writer, [])
    else:
        shutil.rmtree(root / NS.id / WRITERS_DIR / writer)
    lines = kvtier_lines(view.refresh)
    assert view.find(key(0)) is None and len(view) == 0
    view.close()
    return lines


@pytest.mark.parametrize("how", ["restart", "deleted"])
def test_forgetting_many_copies_of_one_chunk_costs_in_proportion_to_their_number(tmp_path, how):
    few = forgetting_copies(tmp_path / "few", 500, how)
    many = forgetting_copies(tmp_path / "many", 2000, how)
    assert many < 6 * few  # four times the copies: about four times the work, not sixteen


def finding_among_copies(root, n: int) -> int:
    """Operations of one ``find`` of a chunk a co-writer's log names in ``n`` slots."""
    root.mkdir(mode=0o700)
    write_log(root, "copies", [(slot, entry(0)) for slot in range(n)])
    view = reader(root)
    view.refresh()
    assert view.writers()[-1].chunks == n
    lines = kvtier_lines(lambda: view.find(key(0)))
    assert view.find(key(0)) is not None and len(view.copies(key(0))) == view_module.COPIES_TRIED
    view.close()
    return lines


def test_a_lookup_costs_the_same_however_many_copies_a_co_writer_names():
    """A co-writer may name one chunk in every slot of its segment: a lookup of it looked
    at every copy under the view's lock (2 s at 200,000: a review), now at one."""
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        few = finding_among_copies(Path(work) / "few", 100)
        many = finding_among_copies(Path(work) / "many", 2000)
    assert many <= few + 5


FOLLOWED_COST = """
import gc, sys, tracemalloc
from tests.test_shared_bounds import key, reader
n = int(sys.argv[2])
gc.collect()
tracemalloc.start()
before = tracemalloc.get_traced_memory()[0]
view = reader(sys.argv[1])
for _ in range(4):
    view.refresh()
gc.collect()
per_chunk = (tracemalloc.get_traced_memory()[0] - before) / n
assert len(view) == n and view.find(key(n - 1)).slot == n - 1
print(per_chunk)
"""


def test_a_chunk_followed_costs_a_reader_a_few_hundred_bytes(tmp_path):
    """(measured in a process of its own: tracemalloc counts every thread's allocations,
    and threads other tests leave running in this one would count too)"""
    import subprocess

    n = 50_000
    write_log(tmp_path, "big", [(slot, entry(slot)) for slot in range(n)])
    root = str(Path(__file__).resolve().parents[1])
    run = subprocess.run([sys.executable, "-c", FOLLOWED_COST, str(tmp_path), str(n)], cwd=root,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0, run.stderr[-3000:]
    per_chunk = float(run.stdout.split()[-1])
    assert per_chunk < 320, per_chunk


def test_empty_directories_never_hide_a_real_writer_under_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(view_module, "followable_writers", lambda paths: 4)
    for n in range(10):  # valid writer ids, sorting before the real writer's
        segment(tmp_path, f"a-{n:03d}").close()
    write_log(tmp_path, "z-real", [(0, entry(7))])
    view = reader(tmp_path)
    view.refresh()
    assert view.find(key(7)) is not None and view.find(key(7)).writer == "z-real"
    view.close()


def test_a_log_of_zeros_costs_a_record_or_two_a_refresh(tmp_path):
    write_log(tmp_path, "zeros", [(slot, entry(slot)) for slot in range(10)])
    os.truncate(tmp_path / NS.id / WRITERS_DIR / "zeros" / LOG_FILE, 64 << 30)  # sparse
    view = reader(tmp_path)
    view.refresh()
    assert len(view) == 10 and view.bytes_read <= 1 << 20
    for _ in range(12):
        before = view.bytes_read
        view.refresh()
        assert view.bytes_read - before <= 3 * RECORD_BYTES
    view.close()


def test_one_refresh_reads_a_bounded_share_and_the_next_ones_go_on(tmp_path, monkeypatch):
    budget = 100 * RECORD_BYTES
    monkeypatch.setattr(view_logs, "REFRESH_BYTES", budget)
    write_log(tmp_path, "busy", [(slot, entry(slot)) for slot in range(250)])
    write_log(tmp_path, "quiet", [(slot, entry(1000 + slot)) for slot in range(10)])
    view = reader(tmp_path)
    view.refresh()
    assert view.bytes_read == budget  # the quiet writer's share, then what it left
    assert view.find(key(1009)) is not None  # the quiet writer is never starved
    view.refresh()
    view.refresh()
    assert len(view) == 260 and view.bytes_read == 260 * RECORD_BYTES
    view.close()


def test_a_log_cut_while_a_refresh_reads_it_ends_that_refresh(tmp_path, monkeypatch):
    from kvtier.io.safefs import SafeDir
    from kvtier.segment import log as log_module
    from kvtier.segment.log import LOG_HEADER_BYTES, LogFollower
    from tests.helpers.hostile import time_bound

    write_log(tmp_path, "cut", [(slot, entry(slot)) for slot in range(10)])
    log_file = tmp_path / NS.id / WRITERS_DIR / "cut" / LOG_FILE
    real = log_module.read_at

    def cut_first(fd, length, offset):  # the writer cuts its log between a look and a read
        if offset >= LOG_HEADER_BYTES:
            os.truncate(log_file, LOG_HEADER_BYTES + 2 * RECORD_BYTES)
        return real(fd, length, offset)

    monkeypatch.setattr(log_module, "read_at", cut_first)
    with SafeDir.open(log_file.parent) as directory, time_bound(10, "a refresh of a cut log"):
        follower = LogFollower(directory, NS.digest(), RAW)
        reset, changes = follower.refresh()
        assert reset and sorted(follower.slots) == [0, 1] and len(changes) == 2
        assert follower.refresh() == (False, [])
        follower.close()


def test_directories_that_are_no_segment_only_fill_the_places_segments_leave(tmp_path):
    """An empty directory may be the segment of a writer that crashed while making it: still
    followed (and reclaimed) while there is room, never in a real segment's place."""
    from kvtier.shared.listing import WriterListing

    for name in ("a-000", "a-001"):
        segment(tmp_path, name).close()
    write_log(tmp_path, "z-real", [(0, entry(7))])
    assert list(WriterListing([str(tmp_path)], NS.id, 4).names(0, "reader")) == [
        "a-000", "a-001", "z-real"]
    assert list(WriterListing([str(tmp_path)], NS.id, 2).names(0, "reader")) == [
        "a-000", "z-real"]
    assert list(WriterListing([str(tmp_path)], NS.id, 2).names(0, "z-real")) == [
        "a-000", "a-001"]


def test_a_late_look_on_another_path_takes_nothing_of_a_paths_share(tmp_path, monkeypatch):
    """A look past its wait on one path reads on beside the next refreshes of the others:
    what it reads counts towards the view's bytes, never towards another path's share."""
    budget = 100 * RECORD_BYTES
    monkeypatch.setattr(view_logs, "REFRESH_BYTES", budget)
    write_log(tmp_path, "busy", [(slot, entry(slot)) for slot in range(250)])
    write_log(tmp_path, "quiet", [(slot, entry(1000 + slot)) for slot in range(10)])
    view = reader(tmp_path)
    real = view._read_log

    def beside(followed, room, budget):  # another path's late look, counting as it reads
        with view._lock:
            view.bytes_read += 50 * RECORD_BYTES
        real(followed, room, budget)
    view._read_log = beside
    view.refresh()
    assert view._path_bytes[0] == budget  # this path's whole share, as alone
    view.close()
