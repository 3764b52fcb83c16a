"""Asking a path's file system to answer within a deadline (kvtier/io/answers.py); a file
system that never answers is tests/test_hung_disk_path.py's."""

import threading

import pytest

from kvtier.io.answers import MIN_WAIT_S, answer_wait, answers, outstanding, wait_for_answer


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
