"""A segment's lock: a look at whether it is held (``locked_here``: ``kvtier inspect`` and
``verify``, another engine's start) never keeps a writer out of its segment, nor tells
another look that the segment is in use."""

import fcntl
import os
import threading

import pytest

from kvtier.io.safefs import CacheDirError, SafeDir
from kvtier.segment.lock import BUSY_WAIT_S, lock_namespace, locked_here
from kvtier.segment.names import LOCK_FILE


@pytest.fixture
def segment(tmp_path):
    (tmp_path / LOCK_FILE).touch()
    with SafeDir.open(tmp_path) as directory:
        yield directory


def held(segment, how):
    fd = os.open(os.path.join(segment.path, LOCK_FILE), os.O_RDWR)
    fcntl.flock(fd, how | fcntl.LOCK_NB)
    return fd


def test_a_writer_taking_its_segment_waits_out_a_look_in_progress(segment):
    look = held(segment, fcntl.LOCK_SH)  # a look holding the lock for a moment
    threading.Timer(BUSY_WAIT_S / 4, os.close, [look]).start()
    fd = lock_namespace(segment, "advice")
    os.close(fd)


def test_a_look_while_another_looks_says_not_in_use(segment):
    look = held(segment, fcntl.LOCK_SH)
    try:
        assert locked_here(segment) is False
    finally:
        os.close(look)


def test_a_writer_holding_its_segment_is_seen_and_keeps_others_out(segment):
    writer = lock_namespace(segment, "advice")
    try:
        assert locked_here(segment) is True
        with pytest.raises(CacheDirError, match="in use by another kvtier process; advice"):
            lock_namespace(segment, "advice")
    finally:
        os.close(writer)
    assert locked_here(segment) is False
