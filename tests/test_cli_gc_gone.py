"""``kvtier gc --gone``: the segments of writers gone that long are removed and their seats
handed back; a writer that is running, or gone for less, is left alone."""

import time

from kvtier import KVStore
from kvtier.ops.cache import namespaces
from kvtier.ops.reclaim import gc
from kvtier.ops.segments import gone_for
from tests.helpers.cli import as_json, kvtier
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.store import config, seq


def writer_config(root, name):
    return config(root, instance_id=name, share_writers=2, share_refresh="off")


def put_and_close(root, name, tokens):
    with KVStore(SMALL, writer_config(root, name)) as store:
        store.put(tokens, make_kv(tokens))
        store.flush()


def segments(root):
    (ns,) = [p for p in root.iterdir() if p.is_dir()]
    return sorted(p.name for p in (ns / "writers").iterdir()), \
        sorted(p.read_text() for p in (ns / "seats").iterdir())


def skipped_running_b(code: int, report: dict) -> bool:
    """Running writer b was skipped as in use (exit 1), or, where its heartbeat wrote its
    lease within the last second (a loaded machine delays its beats), not a candidate at all
    (exit 0): never removed."""
    skipped = [s.split("/")[-1] for s in report["skipped_in_use"]]
    return (code, skipped) in ((1, ["b"]), (0, []))


def test_gc_gone_removes_the_segments_of_writers_gone_that_long_and_frees_their_seats(tmp_path):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    put_and_close(root, "a", seq(0, 3))
    with KVStore(SMALL, writer_config(root, "b")) as running:
        running.put(seq(1000, 2), make_kv(seq(1000, 2)))
        running.flush()
        code, report = as_json("gc", root, "--gone", "1h")
        assert code == 0 and report["segments_removed"] == []  # a stopped moments ago
        time.sleep(1.2)  # b's lease is older than 1 s unless b beat meanwhile: b runs, so
        code, report = as_json("gc", root, "--gone", "1s", "--dry-run")  # it is skipped (exit 1)
        assert [s.split("/")[-1] for s in report["segments_removed"]] == ["a"]
        assert skipped_running_b(code, report)
        assert segments(root) == (["a", "b"], ["a", "b"])
        code, report = as_json("gc", root, "--gone", "1s")
        assert [s.split("/")[-1] for s in report["segments_removed"]] == ["a"]
        assert skipped_running_b(code, report)
        assert segments(root) == (["b"], ["b"])  # b runs: its lock is held
        (ns,) = namespaces(root)
        (b,) = ns.segments
        assert gone_for(b) is None
    with KVStore(SMALL, writer_config(root, "c")) as newcomer:  # a's seat is free again
        assert newcomer.stats().paths_down == {}
    assert segments(root)[1] == ["b", "c"]


def test_gc_gone_says_what_it_did(tmp_path):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    put_and_close(root, "a", seq(0, 2))
    time.sleep(1.1)
    result = kvtier("gc", root, "--gone", "1s")
    assert result.returncode == 0, result.stderr
    assert "removed 0 namespaces and 1 segments of writers gone" in result.stdout
    assert kvtier("gc", root, "--gone", "soon").returncode != 0


def old_seat(ns, name, content, age_s=3600.0):
    import os

    path = ns / "seats" / name
    path.write_bytes(content)
    os.chmod(path, 0o600)
    past = time.time() - age_s
    os.utime(path, (past, past))
    return path


def test_gc_gone_gives_back_seats_that_name_no_writer_with_a_segment(tmp_path):
    """An empty seat (a crash between making it and writing it), one naming a writer whose
    segment was never made, a leftover temporary seat: with no segment, nobody frees them."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    put_and_close(root, "a", seq(0, 2))
    (ns,) = [p for p in root.iterdir() if p.is_dir()]
    orphans = [old_seat(ns, "seat-0001", b""), old_seat(ns, "seat-0002", b"ghost"),
               old_seat(ns, ".seat.tmp-4242-0badc0de", b"b")]
    fresh = old_seat(ns, "seat-0003", b"", age_s=0)  # maybe one being made right now
    kept = old_seat(ns, "seat-0000", b"a")  # a's: its segment is there
    code, report = as_json("gc", root, "--gone", "30m", "--dry-run")
    names = [f"{ns.name}/seats/{p.name}" for p in orphans]
    assert code == 0 and sorted(report["seats_freed"]) == sorted(names)
    assert all(p.exists() for p in orphans)
    code, report = as_json("gc", root, "--gone", "30m")
    assert code == 0 and sorted(report["seats_freed"]) == sorted(names)
    assert report["segments_removed"] == []  # a stopped moments ago
    assert not any(p.exists() for p in orphans) and fresh.exists() and kept.read_text() == "a"


def test_gc_gone_gives_a_seat_back_before_its_segment_directory_goes(tmp_path, monkeypatch):
    """As a reclaim does (tests/test_shared_dir.py): a writer coming back under that id in
    between claims a seat afresh, rather than finding its old one and losing it."""
    import kvtier.ops.removal as removal

    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    put_and_close(root, "a", seq(0, 3))
    seen = []
    plain_remove_dir = removal.remove_dir

    def remove_dir(handle, name):
        if name == "a":
            seen.append(segments(root)[1])
        return plain_remove_dir(handle, name)

    monkeypatch.setattr(removal, "remove_dir", remove_dir)
    time.sleep(1.2)
    report = gc(namespaces(root), gone_s=1.0)
    assert report.segments_removed
    assert seen == [[]]  # a's seat was gone when its directory went
