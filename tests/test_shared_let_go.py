"""A writer a reader stops following leaves nothing of it behind: every copy the reader's
index held of it goes, whether the reader let go after a rotation whose new log it could not
open (a co-writer's hard link or symlink, a name gone, EIO or ESTALE on a network
filesystem) or after a read that failed partway through a refresh (records applied to the
follower's slots before the failure). A lookup never raises for a copy of a segment no
longer followed (it would reach vLLM's scheduler and end the engine), and the writer's
chunks are found again once it is followed again."""

import errno
import os

import pytest

import kvtier.segment.log as log_module
from kvtier.segment.log import FIRST_PIECE, LOG_HEADER_BYTES, RECORD_BYTES, encode_record
from kvtier.segment.names import LOG_FILE, WRITERS_DIR
from kvtier.shared.chunk_index import Copy
from kvtier.shared.view import SharedView
from tests.helpers.cowriter import entry, write_log
from tests.helpers.disk_helpers import NS, RAW, key


def reader(root) -> SharedView:
    return SharedView([str(root)], NS, RAW, ("reader",), 120.0)


def log_path(root, writer: str = "w") -> str:
    return os.path.join(root, NS.id, WRITERS_DIR, writer, LOG_FILE)


def found(view: SharedView, n: int) -> bool:
    return view.find(key(n)) is not None


def failing_reads(monkeypatch, fails: int, at_least: int = LOG_HEADER_BYTES, skip: int = 0) -> None:
    """Of the next reads of a log's records from offset ``at_least`` on, the first ``skip``
    go well and the ``fails`` after them fail (EIO)."""
    real, left = log_module.read_at, [skip, fails]

    def read_at(fd, length, offset):
        if offset >= at_least and left[0] > 0:
            left[0] -= 1
        elif offset >= at_least and left[1] > 0:
            left[1] -= 1
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, length, offset)

    monkeypatch.setattr(log_module, "read_at", read_at)


@pytest.mark.parametrize("swap", ["hard link", "symlink"])
def test_a_log_swapped_for_one_the_reader_refuses_leaves_no_copy_behind(tmp_path, swap):
    write_log(tmp_path, "w", [(i, entry(i)) for i in range(4)])
    view = reader(tmp_path)
    view.refresh()
    assert all(found(view, i) for i in range(4))
    log = log_path(tmp_path)
    if swap == "hard link":  # a new log (a rotation), with a second name: refused
        write_log(tmp_path, "w", [(i, entry(i)) for i in range(4)])
        os.link(log, log + ".extra")
    else:
        os.rename(log, log + ".old")
        os.symlink(LOG_FILE + ".old", log)
    for _ in range(2):
        view.refresh()
        assert len(view) == 0 and view.listen(lambda k, c: None) == []  # (before a find drops any)
        assert not any(found(view, i) for i in range(4))
    if swap == "hard link":
        os.unlink(log + ".extra")
    else:
        os.unlink(log)
        os.rename(log + ".old", log)
    view.refresh()
    assert all(found(view, i) for i in range(4))


def test_a_rotated_log_whose_first_read_fails_leaves_no_copy_behind(tmp_path, monkeypatch):
    write_log(tmp_path, "w", [(i, entry(i)) for i in range(4)])
    view = reader(tmp_path)
    view.refresh()
    write_log(tmp_path, "w", [(i, entry(10 + i)) for i in range(4)])  # new file, new chunks
    failing_reads(monkeypatch, 1)
    view.refresh()
    assert len(view) == 0 and not any(found(view, i) or found(view, 10 + i) for i in range(4))
    view.refresh()  # healthy again: followed anew
    assert not any(found(view, i) for i in range(4))
    assert all(found(view, 10 + i) for i in range(4))


def test_a_read_failing_partway_through_a_refresh_leaves_no_copy_behind(tmp_path, monkeypatch):
    """The writer re-used its slots for other chunks, in more records than one read takes
    (each read takes twice the last, from ``FIRST_PIECE``): the first read's records are
    applied to the follower, the second read fails."""
    slots = 2 * FIRST_PIECE // RECORD_BYTES
    write_log(tmp_path, "w", [(i, entry(i)) for i in range(slots)])
    view = reader(tmp_path)
    view.refresh()
    end = os.path.getsize(log_path(tmp_path))
    with open(log_path(tmp_path), "ab") as f:  # records as the writer appends them
        for turn in (1, 2, 3):
            f.write(b"".join(encode_record(i, entry(turn * slots + i)) for i in range(slots)))
    failing_reads(monkeypatch, 1, at_least=end, skip=1)
    view.refresh()
    assert len(view) == 0 and not any(found(view, i) for i in range(4 * slots))
    view.refresh()
    assert all(found(view, 3 * slots + i) for i in range(slots)) and len(view) == slots


def test_a_copy_of_a_segment_no_longer_followed_is_dropped_at_its_lookup(tmp_path):
    """However such a copy got left in the index, ``find`` drops it rather than raise."""
    write_log(tmp_path, "w", [(0, entry(0))])
    view = reader(tmp_path)
    view.refresh()
    with view._lock:  # white-box: a copy under a source number no segment has
        view._index.put(key(1), Copy(10**6, 1, 0, RAW))
        view._index.put(key(0), Copy(10**6, 1, 0, RAW))
    assert view.find(key(1)) is None and view.find(key(0)) is not None
    assert len(view) == 1 and [c.key for c in view.listen(lambda k, c: None)] == [key(0)]
