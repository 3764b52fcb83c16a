"""``kvtier gc`` and ``kvtier clear`` say exactly what they did and left alone (audit 2 of
the CLI, bugs 1, 2, 3, 5, 6, 10 and 16): every segment or namespace left alone is reported,
the figures count what was freed, a dry run changes nothing, a hard-linked file is never
unlinked, and an error names the entry."""

import errno
import json
import os
import time

import pytest
from typer.testing import CliRunner

from kvtier import KVStore
from kvtier.cli.main import app
from kvtier.io.safefs import SafeDir
from tests.helpers.cli import logged_slots, old_layout_namespace, two_writers
from tests.helpers.hostile import label, make_cache, namespace_of
from tests.helpers.kv import SMALL
from tests.helpers.store import config


def kvtier(*args):
    """``kvtier ARGS`` in this process: (exit code, stdout, stderr); no exception escapes."""
    clean = {k: None for k in os.environ if k.startswith("KVTIER_")}
    result = CliRunner().invoke(app, [str(a) for a in args], env=clean)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def report(*args):
    code, out, _ = kvtier(*args, "--json")
    return code, json.loads(out)


def chunks_of(root, writer):
    """Chunks ``kvtier inspect`` finds in ``writer``'s segment."""
    _, data = report("inspect", root)
    (ns,) = data["namespaces"]
    return {w["writer"]: w["chunks"] for w in ns["writers"]}[writer]


# ---- 1: gc --gone reports the segments it leaves alone --------------------------------


def test_gc_gone_reports_a_segment_that_is_not_a_directory(tmp_path):
    segment = make_cache(tmp_path / "c", 2, instance_id="w-a")
    odd = segment.parent / "w-odd"
    odd.write_bytes(b"not a segment")
    code, data = report("gc", tmp_path / "c", "--gone", "0s")
    assert code == 1 and data["skipped_unsafe"] == [label(odd)]
    assert "not a directory" in data["reasons"][label(odd)]
    assert data["segments_removed"] == [label(segment)] and odd.exists()
    code, out, _ = kvtier("gc", tmp_path / "c", "--gone", "0s")
    assert code == 1 and "left alone 1 not provably kvtier's or unsafe" in out
    assert "w-odd: left alone:" in out


@pytest.mark.parametrize("name", ["log.kvt", "lease", "lock"])
def test_gc_gone_leaves_a_segment_whose_files_are_not_kvtiers_whole(tmp_path, name):
    segment = make_cache(tmp_path / "c", 2)
    (segment / name).unlink()
    os.mkfifo(segment / name, 0o600)
    code, data = report("gc", tmp_path / "c", "--gone", "0s")
    assert code == 1 and data["skipped_unsafe"] == [label(segment)]
    assert "FIFO" in data["reasons"][label(segment)] and not data["segments_removed"]
    assert (segment / "slots-0000.kvt").exists() and (segment / "index.kvt").exists()


def test_gc_gone_reports_a_segment_in_use_that_it_would_otherwise_remove(tmp_path):
    segment = make_cache(tmp_path / "c", 2)
    with KVStore(SMALL, config(tmp_path / "c", share_writers=4)):
        code, data = report("gc", tmp_path / "c", "--gone", "0s")
        assert code == 1 and data["skipped_in_use"] == [label(segment)]
        assert not data["segments_removed"] and segment.exists()
        code, data = report("gc", tmp_path / "c", "--gone", "1h")  # not gone that long
        assert code == 0 and not data["skipped_in_use"]


# ---- 2: namespaces gc cannot read are reported ----------------------------------------


def test_gc_reports_a_damaged_namespace_and_frees_the_others(tmp_path):
    damaged = namespace_of(make_cache(tmp_path, 2, model="damaged"))
    make_cache(tmp_path, 3, model="fine")
    (damaged / "namespace.json").write_text("[[[[")
    code, data = report("gc", tmp_path, "--target", "0")
    assert code == 0 and data["chunks_freed"] == 3 and data["unreadable"] == [damaged.name]
    assert "damaged" in data["reasons"][damaged.name]
    assert "not JSON" in data["reasons"][damaged.name]
    code, out, _ = kvtier("gc", tmp_path, "--older-than", "0s", "--dry-run")
    assert code == 0 and "left alone 1 namespaces not read" in out
    assert f"{damaged.name[:12]}: left alone: damaged" in out


def test_gc_reports_stale_and_orphaned_namespaces_without_stale(tmp_path):
    orphan = namespace_of(make_cache(tmp_path, 2, model="orphan"))
    (orphan / "namespace.json").unlink()
    stale = old_layout_namespace(tmp_path)
    code, data = report("gc", tmp_path, "--older-than", "0s")
    assert code == 0 and sorted(data["unreadable"]) == sorted([orphan.name, stale.name])
    assert "--stale removes it" in data["reasons"][orphan.name]
    assert "format version 1" in data["reasons"][stale.name]
    code, data = report("gc", tmp_path, "--stale")
    assert data["namespaces_removed"] == sorted([orphan.name, stale.name])


# ---- 3: the figures count what was freed, and a segment is freed whole or not at all ---


def failing_for(writer, what):
    def fail(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", f"{writer}/{what}")
    return fail


def test_gc_frees_nothing_in_a_segment_whose_log_cannot_be_restarted(tmp_path, monkeypatch):
    from kvtier.ops import segments

    _, b = two_writers(tmp_path)
    real = segments.SegmentLog

    def log(directory, *args, **kwargs):
        if directory.path.endswith("w-b"):
            failing_for("w-b", ".log.kvt.tmp-1-0123abcd")()
        return real(directory, *args, **kwargs)
    monkeypatch.setattr(segments, "SegmentLog", log)
    code, data = report("gc", tmp_path, "--older-than", "0s")
    assert code == 1 and data["chunks_freed"] == 3 and list(data["left"]) == [label(b)]
    assert "Permission denied" in data["left"][label(b)][0]
    assert "w-b/.log.kvt.tmp" in data["left"][label(b)][0]  # it names the entry
    assert chunks_of(tmp_path, "w-b") == 2 and logged_slots(b) == {0, 1}  # whole
    assert chunks_of(tmp_path, "w-a") == 0


def test_gc_frees_nothing_in_a_segment_whose_slot_file_cannot_be_written(tmp_path, monkeypatch):
    _, b = two_writers(tmp_path)
    real = SafeDir.open_file

    def open_file(self, name, flags, **kwargs):
        if self.path.endswith("w-b") and name.startswith("slots-") and flags & os.O_RDWR:
            failing_for("w-b", name)()
        return real(self, name, flags, **kwargs)
    monkeypatch.setattr(SafeDir, "open_file", open_file)
    code, data = report("gc", tmp_path, "--older-than", "0s")
    assert code == 1 and data["chunks_freed"] == 3 and list(data["left"]) == [label(b)]
    monkeypatch.undo()
    assert chunks_of(tmp_path, "w-b") == 2 and report("verify", tmp_path)[0] == 0


def test_gc_counts_the_chunks_it_freed_before_a_failure(tmp_path, monkeypatch):
    from kvtier.ops import slot_freeing

    a, b = two_writers(tmp_path)
    monkeypatch.setattr(slot_freeing, "_punch", failing_for("w", "slots-0000.kvt"))
    code, data = report("gc", tmp_path, "--older-than", "0s")
    assert code == 1 and data["chunks_freed"] == 5  # every index entry was blanked
    assert sorted(data["left"]) == sorted([label(a), label(b)])
    assert chunks_of(tmp_path, "w-a") == chunks_of(tmp_path, "w-b") == 0


# ---- 5: a dry run changes nothing ------------------------------------------------------


def test_gc_gone_dry_run_leaves_a_linked_seat_temporary_file(tmp_path):
    ns = namespace_of(make_cache(tmp_path, 2))
    seat, temp = ns / "seats" / "seat-0000", ns / "seats" / ".seat.tmp-123-abcdef01"
    os.link(seat, temp)  # a crash of write_seat between the link and the unlink
    past = time.time() - 3600
    os.utime(seat, (past, past))
    code, data = report("gc", tmp_path, "--gone", "10m", "--dry-run")
    assert code == 0 and data["seats_freed"] == [f"{ns.name}/seats/{temp.name}"]
    assert temp.exists() and seat.stat().st_nlink == 2
    code, data = report("gc", tmp_path, "--gone", "10m")
    assert code == 0 and data["seats_freed"] == [f"{ns.name}/seats/{temp.name}"]
    assert not temp.exists() and seat.stat().st_nlink == 1 and seat.exists()


# ---- 6: a file with more than one link is never unlinked -------------------------------


@pytest.mark.parametrize("name", ["slots-0000.kvt", "index.kvt", "seat"])
def test_clear_never_unlinks_a_hard_linked_file(tmp_path, name):
    segment = make_cache(tmp_path / "c", 2)
    target = namespace_of(segment) / "seats" / "seat-0000" if name == "seat" else segment / name
    outside = tmp_path / "outside"
    os.link(target, outside)
    code, data = report("clear", tmp_path / "c", "--yes")
    assert code == 1 and target.exists() and outside.stat().st_nlink == 2
    left = [" ".join(entries) for entries in data["left"].values()]  # what, or why
    assert any(target.name in entries or "seats" in entries for entries in left)


@pytest.mark.parametrize("name", ["slots-0000.kvt", "index.kvt", "seat"])
def test_gc_gone_never_unlinks_a_hard_linked_file(tmp_path, name):
    segment = make_cache(tmp_path / "c", 2)
    target = namespace_of(segment) / "seats" / "seat-0000" if name == "seat" else segment / name
    outside = tmp_path / "outside"
    os.link(target, outside)
    past = time.time() - 3600
    os.utime(target, (past, past))  # an old seat: it would count as an orphan if it were read
    code, data = report("gc", tmp_path / "c", "--gone", "0s")
    assert target.exists() and outside.stat().st_nlink == 2
    if name == "seat":  # the segment goes; the seat it cannot read stays
        assert data["segments_removed"] == [label(segment)] and not data["seats_freed"]
    else:
        assert code == 1 and data["skipped_unsafe"] == [label(segment)]
        assert "hard links" in data["reasons"][label(segment)]


# ---- 10: durations too long to be an age ---------------------------------------------------


@pytest.mark.parametrize("option", ["--older-than", "--gone"])
@pytest.mark.parametrize("value", ["1" + "0" * 300 + "w", "36501d"])
def test_gc_refuses_a_duration_longer_than_100_years(tmp_path, option, value):
    make_cache(tmp_path, 1)
    code, out, err = kvtier("gc", tmp_path, option, value, "--dry-run")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"kvtier: gc: {option}") and "36500d" in err and len(err) < 300


def test_gc_takes_a_duration_of_100_years(tmp_path):
    make_cache(tmp_path, 1)
    assert report("gc", tmp_path, "--older-than", "36500d", "--gone", "36500d")[0] == 0


# ---- 16: errors name the entry ---------------------------------------------------------


def test_clear_names_the_directory_it_cannot_remove(tmp_path, monkeypatch):
    ns = namespace_of(make_cache(tmp_path, 1))
    real = SafeDir.remove_dir

    def remove_dir(self, name):
        if name == ns.name:
            raise PermissionError(errno.EACCES, "Permission denied", name)
        return real(self, name)
    monkeypatch.setattr(SafeDir, "remove_dir", remove_dir)
    code, out, _ = kvtier("clear", tmp_path, "--yes")
    assert code == 1
    expected = f"{ns.name[:12]}: left cannot remove {tmp_path}/{ns.name}: Permission denied"
    assert expected in " ".join(out.split())  # as one line, however the console wrapped it
