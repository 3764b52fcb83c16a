"""The offline cache commands where a review found them wrong: an index entry naming another
chunk than its slot holds, a halt file that cannot be removed, an empty ``--namespace`` or
one naming none, a timeout too large for a timer, ``clear --json`` asking its question,
``gc --stale``'s report, and a ``writers/`` directory stuffed with writer-like entries."""

import errno
import fcntl
import json
import os
import shutil
import time

import pytest

from kvtier import KVStore
from kvtier.keys import namespace_id_of
from kvtier.segment.halt_file import HaltFile
from tests.helpers.cli import as_json, kvtier, two_writers
from tests.helpers.hostile import cli, make_cache, namespace_of
from tests.helpers.kv import SMALL
from tests.helpers.store import config, exact, seq

ENTRY = 128  # an index entry: the first bytes of its slot's header


def _entry_of_slot_1_at_slot_0(segment):
    """What a crash between a slot's write and its index entry's leaves: slot 0's entry
    names the chunk of slot 1."""
    index = segment / "index.kvt"
    data = bytearray(index.read_bytes())
    data[0:ENTRY] = data[ENTRY:2 * ENTRY]
    index.write_bytes(bytes(data))


def test_verify_finds_and_repairs_an_index_entry_naming_another_chunk(tmp_path):
    root = tmp_path / "cache"
    segment = make_cache(root, 2)
    _entry_of_slot_1_at_slot_0(segment)
    with KVStore(SMALL, config(root, share_writers=4)) as store:
        assert exact(store, seq(0, 2)) == 0  # a restart looks for another chunk in slot 0
    code, out = cli("verify", root, "--json")
    writer = json.loads(out[out.index("{"):])["namespaces"][0]["writers"][0]
    assert code == 1 and writer["unindexed"] == [0], writer
    code, _ = cli("verify", root, "--repair")
    assert code == 0
    assert cli("verify", root)[0] == 0
    with KVStore(SMALL, config(root, share_writers=4)) as store:
        assert exact(store, seq(0, 2)) == len(seq(0, 2))  # both chunks found again


def test_verify_repair_says_a_halt_file_it_cannot_remove_is_a_problem(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    HaltFile(root, namespace_of(make_cache(root, 2)).name).write({"why": "test"})
    unlink = os.unlink

    def read_only(name, *args, **kwargs):
        if name == "halt.json":
            raise OSError(errno.EROFS, "Read-only file system")
        return unlink(name, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", read_only)
    code, out = cli("verify", root, "--repair", "--json")
    report = json.loads(out[out.index("{"):])["namespaces"][0]
    assert code == 1 and not report["halt_removed"]
    assert report["problem"].startswith("halt.json not removed: ")
    assert report["problem"].endswith("halt.json: Read-only file system"), report["problem"]


@pytest.mark.parametrize("what", ["hard link", "oversized"])
def test_a_halt_file_kvtier_cannot_read_is_a_problem_not_no_halt(tmp_path, what):
    """An engine halted before keeps its halt when it cannot read the file; verify took it
    for no halt and said all was well (a review)."""
    root = tmp_path / "cache"
    ns = namespace_of(make_cache(root, 2))
    HaltFile(root, ns.name).write({"why": "test"})
    if what == "hard link":
        os.link(ns / "halt.json", tmp_path / "another-name")
    else:
        (ns / "halt.json").write_bytes(b" " * 5000)
    for repair in ((), ("--repair",)):
        code, out = cli("verify", root, "--json", *repair)
        report = json.loads(out[out.index("{"):])["namespaces"][0]
        assert code == 1 and "halt.json cannot be told" in report["problem"], report
    _, inspected = as_json("inspect", root)
    assert "halt.json cannot be told" in inspected["namespaces"][0]["problem"]
    assert (ns / "halt.json").exists()  # not kvtier's to remove


def test_an_empty_namespace_prefix_is_refused_not_taken_for_every_namespace(tmp_path):
    root = tmp_path / "cache"
    ns = namespace_of(make_cache(root, 1))
    for command in (["clear", "--yes"], ["gc", "--stale"], ["verify"], ["inspect"]):
        result = kvtier(command[0], root, "--namespace", "", *command[1:])
        assert result.returncode == 2 and "--namespace is empty" in result.stderr, command
    assert ns.exists()


def test_a_namespace_prefix_naming_none_fails_and_an_empty_root_says_so(tmp_path):
    """A typo in ``--namespace`` is not "all clear" (exit 1, naming it); a root where no
    engine has written says that, not an empty table."""
    root = tmp_path / "cache"
    ns = namespace_of(make_cache(root, 1))
    other = "f" if not ns.name.startswith("f") else "e"
    for command in (["clear", "--yes"], ["gc", "--stale"], ["verify"], ["inspect"]):
        result = kvtier(command[0], root, "--namespace", other, *command[1:])
        assert result.returncode == 1, (command, result.stdout, result.stderr)
        assert f"no namespace under {root} has an id starting with '{other}'" in result.stderr
    assert ns.exists()
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    for command in ("verify", "inspect"):
        result = kvtier(command, empty)
        assert result.returncode == 0 and "no kvtier namespace under" in result.stdout, command


def test_a_timeout_past_what_a_timer_takes_is_no_deadline(tmp_path):
    root = tmp_path / "cache"
    make_cache(root, 1)
    result = kvtier("inspect", root, "--timeout", "1e10")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


def test_clear_json_asks_on_stderr_and_prints_only_json(tmp_path):
    root = tmp_path / "cache"
    make_cache(root, 1)
    result = kvtier("clear", root, "--json", stdin="y\n")
    assert result.returncode == 0
    assert json.loads(result.stdout)["removed"] and "Remove 1 namespace" in result.stderr


def _stale_copy(root):
    """Two writers' namespace, relabelled as an older format version's."""
    a, _ = two_writers(root)
    ns = a.parent.parent
    meta = json.loads((ns / "namespace.json").read_text())
    described = json.loads(meta["namespace"])
    described["format_version"] = 2
    meta["namespace"] = json.dumps(described, sort_keys=True)
    moved = root / namespace_id_of(meta["namespace"])
    shutil.move(ns, moved)
    (moved / "namespace.json").write_text(json.dumps(meta))
    return moved


def test_gc_stale_reports_the_segments_it_removes_and_its_dry_run_says_so_first(tmp_path):
    ns = _stale_copy(tmp_path)
    fd = os.open(ns / "writers" / "w-a" / "lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # w-a is running
    try:
        _, dry = as_json("gc", tmp_path, "--stale", "--dry-run")
        _, real = as_json("gc", tmp_path, "--stale")
    finally:
        os.close(fd)
    assert (ns / "writers" / "w-a").exists() and not (ns / "writers" / "w-b").exists()
    for report in (dry, real):
        assert [s.rsplit("/", 1)[-1] for s in report["segments_removed"]] == ["w-b"], report
        assert [s.rsplit("/", 1)[-1] for s in report["skipped_in_use"]] == ["w-a"], report
        assert report["namespaces_removed"] == []


def test_gc_stale_dry_run_says_what_the_run_does_with_an_unsafe_segment_and_leaves_no_lock(tmp_path):
    """A stale namespace one of whose segments holds a symlink: the dry run promised the
    namespace removed where the run left it (exit 1), and the run left a lock file it made
    in the namespace directory (a review)."""
    ns = _stale_copy(tmp_path / "root")
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    (ns / "writers" / "w-b" / "slots-0001.kvt").symlink_to(outside)
    code_dry, dry = as_json("gc", tmp_path / "root", "--stale", "--dry-run")
    code, real = as_json("gc", tmp_path / "root", "--stale")
    for report in (dry, real):
        assert report["namespaces_removed"] == [], report
        assert [s.rsplit("/", 1)[-1] for s in report["segments_removed"]] == ["w-a"], report
        assert [s.rsplit("/", 1)[-1] for s in report["skipped_unsafe"]] == ["w-b"], report
    assert code_dry == code == 1
    assert not (ns / "lock").exists() and outside.read_bytes() == b"precious"


def test_inspect_lists_thousands_of_writer_like_entries_a_line_each(tmp_path):
    root = tmp_path / "cache"
    segment = make_cache(root, 1)
    for i in range(1500):  # a co-writer's junk named like writer ids
        os.mkdir(segment.parent / f"junk-{i}", 0o700)
    started = time.monotonic()
    result = kvtier("inspect", root, "--timeout", "60")
    assert result.returncode == 0, result.stderr
    assert "writers: 1,501 rows, one a line (more than 1,000 for a table)" in result.stdout
    assert "junk-1499" in result.stdout and time.monotonic() - started < 60
