"""Asking a path's file system to answer within a deadline (kvtier/io/answers.py); a file
system that never answers is tests/test_hung_disk_path.py's."""

import errno
import threading

import pytest

from kvtier.io.answers import MIN_WAIT_S, answer_wait, answers, outstanding, wait_for_answer
from tests.helpers.disk_helpers import wait_until


def test_a_directory_answers_and_no_question_is_left_behind(tmp_path):
    wait_for_answer(str(tmp_path), 5.0)
    wait_for_answer(str(tmp_path), None)
    assert answers(str(tmp_path), 5.0)
    assert outstanding() == 0


def test_an_error_is_an_answer(tmp_path):
    with pytest.raises(FileNotFoundError):
        wait_for_answer(str(tmp_path / "gone"), 5.0)
    assert answers(str(tmp_path / "gone"), 5.0)


def test_a_soft_mounts_timeout_is_said_as_its_own_and_is_no_answer(tmp_path, monkeypatch):
    """A soft NFS mount whose server is gone answers ETIMEDOUT after its own timeout: said as
    that, not as a path that did not answer at all, and taken as no answer."""
    import errno
    import os

    def timed_out(path):
        raise OSError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT), path)

    monkeypatch.setattr(os, "statvfs", timed_out)
    path = str(tmp_path / "soft")
    with pytest.raises(TimeoutError, match="server timed out") as raised:
        wait_for_answer(path, 5.0)
    assert raised.value.errno == errno.ETIMEDOUT and "did not answer" not in str(raised.value)
    assert not answers(path, 5.0)
    assert outstanding() == 0


def test_a_path_is_given_at_least_min_wait_s():
    assert answer_wait(0.001) == MIN_WAIT_S and answer_wait(30.0) == 30.0 and answer_wait(None) is None


def test_a_recent_answer_stands_for_the_next_question(tmp_path, monkeypatch):
    assert answers(str(tmp_path), 5.0)
    monkeypatch.setattr(threading.Thread, "start", fail_start)  # no question can be asked
    assert answers(str(tmp_path), 5.0)


def test_a_thread_that_cannot_start_is_no_answer_this_time_and_poisons_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "fresh")
    (tmp_path / "fresh").mkdir()
    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", fail_start)
        assert not answers(path, 5.0)
        assert outstanding() == 0
    assert answers(path, 5.0) and outstanding() == 0


def fail_start(self):
    raise RuntimeError("can't start new thread")


def test_a_path_statvfs_refuses_is_an_answer_and_leaves_no_question(tmp_path, monkeypatch):
    """Whatever ``statvfs`` raises is its answer (a path it refuses: the open then says what
    is wrong), never a question held for ever nor a hung mount."""
    import os

    def refused(path):
        raise ValueError("embedded null byte")

    monkeypatch.setattr(os, "statvfs", refused)
    path = str(tmp_path / "refused")
    with pytest.raises(ValueError):
        wait_for_answer(path, 5.0)
    assert answers(path, 5.0) and outstanding() == 0


def test_an_answer_however_recent_is_asked_again_with_fresh_s_0(tmp_path, monkeypatch):
    """A mount that hung just after it answered: a look that must not block (the shared
    view's, on its one thread) asks again rather than take the recent answer."""
    import os

    import kvtier.io.answers as answers_module

    path = str(tmp_path)
    assert answers(path, 5.0)
    release, real = threading.Event(), os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: release.wait(10) and real(p))  # hung now
    monkeypatch.setattr(answers_module, "MIN_WAIT_S", 0.2)
    try:
        assert answers(path, 0.2)  # the recent answer stands for a plain question
        assert not answers(path, 0.2, fresh_s=0)  # asked afresh: no answer
        assert outstanding(path) == 1 and outstanding(path + "-other") == 0
    finally:
        release.set()
    wait_until(lambda: outstanding() == 0, "the question held to end")


def test_the_shared_view_asks_each_path_before_each_look(tmp_path, monkeypatch):
    import kvtier.shared.view as view_module
    from kvtier.shared.view import SharedView
    from tests.helpers.worker_side import GEO

    asked = []
    monkeypatch.setattr(view_module, "ask", lambda roots, timeout, fresh_s=5.0:
                        asked.append(("ask", tuple(roots), fresh_s)))
    monkeypatch.setattr(view_module, "answers", lambda root, timeout, fresh_s=5.0:
                        asked.append(("wait", root, fresh_s)) or False)
    roots = (str(tmp_path / "a"), str(tmp_path / "b"))
    view = SharedView(roots, GEO.namespace("m", "", 1, 0), GEO.chunk_bytes, ("b", "b"), 30)
    view.refresh()
    # every path asked at once (hung ones cost one wait), none taking a recent answer
    assert asked == [("ask", roots, 0), ("wait", roots[0], 0), ("wait", roots[1], 0)]


def test_a_special_file_at_the_path_answers_at_once_without_being_opened(tmp_path):
    """The question opens the path's directory too (``O_DIRECTORY``): a FIFO put at the
    path is refused before it is opened, never waited on for a writer."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotADirectoryError):
        wait_for_answer(str(fifo), 5.0)
    assert answers(str(fifo), 5.0) and outstanding(str(fifo)) == 0


def test_a_symlink_at_the_path_is_not_followed_by_the_question(tmp_path):
    """A path that is a symlink answers (refused, as ``SafeDir.open`` refuses it) without
    its target being asked: a hostile link to a hung mount holds no question."""
    import os

    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "link")
    with pytest.raises(OSError) as raised:
        wait_for_answer(str(tmp_path / "link"), 5.0)
    assert raised.value.errno in (errno.ELOOP, errno.ENOTDIR)  # (not followed: refused)
