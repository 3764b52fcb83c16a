"""Reading slot headers alone (``kvtier/segment/slot_headers.py``), as KV events read the
token records of chunks on disk: only regular files of this user, never through a symlink,
never blocked by a FIFO, nothing past a short file, nothing from a missing segment."""

import os
import time

import pytest

from kvtier.io.format import HEADER_BYTES, decode_header
from kvtier.segment.names import SLOT_FILE
from kvtier.segment.slot_headers import read_headers
from tests.helpers.cowriter import segment
from tests.helpers.disk_helpers import NS, RAW, chunk, key, make_tier

STRIDE = 4096 + -(-RAW // 4096) * 4096


def written(tmp_path, count: int = 3) -> str:
    """A segment whose writer holds chunks 0..count-1 in slots 0..count-1; its writer id."""
    tier = make_tier([tmp_path], writers=["w"])
    for n in range(count):
        assert tier.write(n, key(n), chunk(n).array).ok
    tier.close()
    return "w"


def test_each_header_asked_for_is_read_and_is_its_chunks(tmp_path):
    writer = written(tmp_path)
    got = read_headers(str(tmp_path), NS.id, writer, STRIDE, [2, 0, 0, 1])
    assert sorted(got) == [0, 1, 2]
    assert all(len(data) == HEADER_BYTES and decode_header(data).key == key(n)
               for n, data in got.items())
    assert read_headers(str(tmp_path), NS.id, writer, STRIDE, [40]) == {}  # past the file


def test_a_missing_segment_and_a_missing_file_read_nothing(tmp_path):
    assert read_headers(str(tmp_path), NS.id, "nobody", STRIDE, [0]) == {}
    segment(tmp_path, "empty").close()
    assert read_headers(str(tmp_path), NS.id, "empty", STRIDE, [0, 1]) == {}


def test_a_symlinked_slot_file_or_segment_is_not_followed(tmp_path):
    writer = written(tmp_path)
    base = tmp_path / NS.id / "writers"
    (base / "linked").mkdir(mode=0o700)
    os.symlink(base / writer / SLOT_FILE.format(0), base / "linked" / SLOT_FILE.format(0))
    assert read_headers(str(tmp_path), NS.id, "linked", STRIDE, [0]) == {}
    os.symlink(base / writer, base / "alias")
    assert read_headers(str(tmp_path), NS.id, "alias", STRIDE, [0]) == {}


def test_a_fifo_in_place_of_a_slot_file_neither_blocks_nor_reads(tmp_path):
    segment(tmp_path, "fifo").close()
    os.mkfifo(tmp_path / NS.id / "writers" / "fifo" / SLOT_FILE.format(0), 0o600)
    started = time.monotonic()
    assert read_headers(str(tmp_path), NS.id, "fifo", STRIDE, [0]) == {}
    assert time.monotonic() - started < 5


def test_a_file_cut_inside_a_header_gives_no_header_for_that_slot(tmp_path):
    writer = written(tmp_path, 2)
    path = tmp_path / NS.id / "writers" / writer / SLOT_FILE.format(0)
    os.truncate(path, STRIDE + 100)  # slot 1's header cut short
    got = read_headers(str(tmp_path), NS.id, writer, STRIDE, [0, 1])
    assert list(got) == [0]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
def test_a_slot_file_of_another_user_is_not_read(tmp_path):
    writer = written(tmp_path)
    os.chown(tmp_path / NS.id / "writers" / writer / SLOT_FILE.format(0), 65534, 65534)
    assert read_headers(str(tmp_path), NS.id, writer, STRIDE, [0, 1]) == {}
