"""A file under the cache root with a second hard link may be linked from outside it: no
removal by the engine or the CLI unlinks it, except the one second link kvtier makes itself
for a moment (a seat's temporary file, ``write_seat``), and then only when the other link is
the seat beside it."""

import os
import time

import pytest

from kvtier import KVStore
from kvtier.io.safefs import SafeDir, UnsafeEntry
from kvtier.segment import seat_orphans, seats
from kvtier.shared.view import SharedView
from tests.helpers.hostile import make_cache, namespace_of, seat_file, stopped_writer_namespace
from tests.helpers.kv import SMALL
from tests.helpers.shared import shared


def test_a_file_with_a_second_link_is_never_removed(tmp_path):
    (tmp_path / "d").mkdir()
    inside, outside = tmp_path / "d" / "file", tmp_path / "outside"
    outside.write_bytes(b"precious")
    os.link(outside, inside)
    with SafeDir.open(tmp_path / "d") as directory:
        with pytest.raises(UnsafeEntry, match="2 hard links"):
            directory.remove_file("file")
        assert inside.exists() and outside.stat().st_nlink == 2
        assert directory.remove_file("file", links=2)  # the caller proved the other link
    assert not inside.exists() and outside.read_bytes() == b"precious"


def test_the_engine_gives_back_no_orphan_seat_linked_from_outside(tmp_path):
    """An old seat naming no writer is an orphan, but one linked from elsewhere is not
    provably kvtier's: the engine's view leaves it (and its writers stay out)."""
    (tmp_path / "c").mkdir(mode=0o700)
    ns = stopped_writer_namespace(tmp_path / "c")
    seat = seat_file(ns, b"", age_s=3600)
    outside = tmp_path / "outside"
    os.link(seat, outside)
    quick = {"share_writers": 1, "lease_timeout": "2s", "share_refresh": "1h"}
    now = [0.0]  # the reader's clock, moved by hand
    with KVStore(SMALL, shared(tmp_path / "c", "b", **quick)) as b:
        view = SharedView([str(tmp_path / "c")], b.namespace, b.chunk_bytes, ("b",), 2.0,
                          clock=lambda: now[0])
        for _ in range(2):  # watched for longer than lease_timeout: it would be due
            view.refresh()
            now[0] += 1.1
        view.refresh()
        assert view.seats_freed == 0 and b.stats().paths_down
        view.close()
    assert seat.exists() and outside.stat().st_nlink == 2
    with SafeDir.open(ns) as ns_dir:
        assert seat_orphans.orphan_seats(ns_dir, 2.0) == []
        assert seat_orphans.free_orphan_seats(ns_dir, 2.0) == []


def crash_left_pair(ns):
    """A seat and its temporary file still linked to it (``write_seat`` killed between the
    link and the unlink)."""
    seat, temp = ns / "seats" / "seat-0000", ns / "seats" / ".seat.tmp-123-abcdef01"
    os.link(seat, temp)
    return seat, temp


def test_claiming_a_seat_removes_a_temporary_file_linked_to_its_seat_only(tmp_path):
    ns = namespace_of(make_cache(tmp_path / "c", 2))
    seat, temp = crash_left_pair(ns)
    stray, outside = ns / "seats" / ".seat.tmp-456-abcdef02", tmp_path / "outside"
    outside.write_bytes(b"precious")
    os.link(outside, stray)  # a temporary file's name, its other link outside the seats
    with SafeDir.open(ns) as ns_dir:
        seats.claim_seat(ns_dir, "b", 4)
    assert not temp.exists() and seat.stat().st_nlink == 1
    assert stray.exists() and outside.stat().st_nlink == 2


def test_an_old_crash_left_pair_loses_its_temporary_file_then_the_seat_is_judged(tmp_path):
    ns = stopped_writer_namespace(tmp_path)
    seat = seat_file(ns, b"ghost")
    temp = ns / "seats" / ".seat.tmp-123-abcdef01"
    os.link(seat, temp)
    past = time.time() - 3600
    os.utime(seat, (past, past))
    with SafeDir.open(ns) as ns_dir:
        assert seat_orphans.free_orphan_seats(ns_dir, 2.0, dry_run=True) == [temp.name]
        assert temp.exists()
        assert seat_orphans.free_orphan_seats(ns_dir, 2.0) == [temp.name]
        assert not temp.exists() and seat.stat().st_nlink == 1
        assert seat_orphans.free_orphan_seats(ns_dir, 2.0) == [seat.name]  # one link: an orphan
    assert not seat.exists()


def test_clear_removes_a_crash_left_pair(tmp_path):
    from tests.helpers.hostile import cli

    root = tmp_path / "c"
    ns = namespace_of(make_cache(root, 2))
    crash_left_pair(ns)
    cli("clear", root, "--yes")
    assert not ns.exists()


def test_reclaiming_a_segment_never_unlinks_a_file_linked_from_outside(tmp_path):
    segment = make_cache(tmp_path / "c", 2)
    ns, outside = namespace_of(segment), tmp_path / "outside"
    os.link(segment / "slots-0000.kvt", outside)
    before = outside.read_bytes()
    with SafeDir.open(ns) as ns_dir, pytest.raises(UnsafeEntry, match="hard links"):
        seats.reclaim_segment(ns_dir, segment.name, os.lstat(segment).st_ino)
    assert outside.read_bytes() == before and outside.stat().st_nlink == 2
    assert (ns / "seats" / "seat-0000").exists()  # the seat goes only with the segment
