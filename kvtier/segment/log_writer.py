"""The writer's side of a segment's index log (``log.kvt``: the format and the reader's side
are ``log.py``'s): one record appended after each slot write or blanking, the file started
afresh from the segment's dense index when it grows past ``rotate_after`` records."""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading

from kvtier.io.safefs import SafeDir
from kvtier.segment.log import RECORD_BYTES, Snapshot, encode_record, encode_records, file_header
from kvtier.segment.names import LOG_FILE

log = logging.getLogger("kvtier")


class SegmentLog:
    """The writer's side: ``append(local_slot, entry)`` records a slot written (or emptied,
    with a blank entry); thread-safe. The log starts afresh from ``snapshot()`` when opened
    and whenever it passes ``rotate_after`` records. A record is written whole or the log's
    end does not move: after a short write the rest is written again, and an ``OSError``
    from ``append`` (a call that failed or wrote nothing) leaves the end where the last
    whole record ends, the torn bytes past it (the file's end: a reader reads whole records
    only, each checked) written over by the next record. Such an ``OSError`` means the
    record is missing: the caller fails the write it belongs to. A rotation that
    fails (a full disk) does not: the record is in the old log, appended to until a later
    try, ``rotate_after // 4`` records on, succeeds (logged once); one whose new log took
    the old one's place but could not be opened is tried again at the next append (records
    meanwhile reach no reader: the new log's snapshot covers them)."""

    def __init__(self, directory: SafeDir, namespace: bytes, snapshot: Snapshot,
                 rotate_after: int) -> None:
        self._dir, self._namespace, self._snapshot = directory, namespace, snapshot
        self._rotate_after = rotate_after
        self._lock = threading.Lock()
        self._fd = -1
        self._end = self.records = 0
        self.rotations = 0
        self._rotate_at = rotate_after  # records past which the next rotation is tried
        self._rotation_failed = self._replaced = False
        with self._lock:
            self._start()

    def _start(self) -> None:
        self._replaced = False  # (a snapshot that fails replaces nothing)
        snapshot = self._snapshot()
        data = file_header(self._namespace, secrets.randbits(64)) + encode_records(snapshot)
        self._dir.replace_file(LOG_FILE, data)
        self._replaced = True  # the old log is no longer the one readers follow
        fd = self._dir.open_file(LOG_FILE, os.O_RDWR)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._end, self.records = fd, len(data), len(snapshot[0])
        self._rotate_at = self._rotate_after

    def restart(self) -> None:
        """Start afresh from ``snapshot()`` now (the index was replaced)."""
        with self._lock:
            self._start()
            self.rotations += 1

    def append(self, local_slot: int, entry: bytes | memoryview) -> None:
        record = encode_record(local_slot, entry)
        with self._lock:
            if self._fd < 0:
                raise OSError(9, "the segment's log was closed")
            _write_whole(self._fd, record, self._end)
            self._end += RECORD_BYTES
            self.records += 1
            if self.records > self._rotate_at:
                self._rotate()

    def _rotate(self) -> None:
        """Start afresh (lock held); on failure go on appending to the old log, or, when
        the new one was put in its place but could not be opened, try again at once."""
        try:
            self._start()
        except OSError as exc:
            self._rotate_at = self.records + (0 if self._replaced else max(1, self._rotate_after // 4))
            if not self._rotation_failed:
                log.warning("kvtier: the segment's log could not start afresh (%s); records go "
                            "on to the old one, tried again every %d records (further failures "
                            "are not logged)", exc, max(1, self._rotate_after // 4))
            self._rotation_failed = True
            return
        self.rotations += 1

    @property
    def size(self) -> int:
        return self._end

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _write_whole(fd: int, record: bytes, offset: int) -> None:
    """Write ``record`` at ``offset`` of ``fd``, the rest again after a short write (a full
    disk midway, a signal, a network filesystem); ``OSError`` when a call fails or writes
    nothing."""
    done = 0
    while done < len(record):
        wrote = os.pwrite(fd, record[done:], offset + done)
        if wrote <= 0:
            raise OSError(errno.EIO, f"a record of the segment's log was written short ({done} "
                          f"of {len(record)} bytes, then a write wrote nothing)")
        done += wrote
