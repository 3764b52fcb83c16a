"""Asking a path's file system to answer within a deadline (kvtier/io/answers.py); a file
system that never answers is tests/test_hung_disk_path.py's."""

import pytest

from kvtier.io.answers import answers, outstanding, wait_for_answer


def test_a_directory_answers_and_no_question_is_left_behind(tmp_path):
    wait_for_answer(str(tmp_path), 5.0)
    wait_for_answer(str(tmp_path), None)
    assert answers(str(tmp_path), 5.0)
    assert outstanding() == 0


def test_an_error_is_an_answer(tmp_path):
    with pytest.raises(FileNotFoundError):
        wait_for_answer(str(tmp_path / "gone"), 5.0)
    assert answers(str(tmp_path / "gone"), 5.0)
