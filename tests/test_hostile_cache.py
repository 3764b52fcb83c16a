"""A hostile cache directory: nothing outside the root is touched, nothing kvtier did not
write is deleted, special files never block, bad entries become a path out of service or a
clean CLI error. Each test names the finding of the hardening issue it reproduces."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from kvtier import KVStore
from kvtier.keys import namespace_id_of
from tests.helpers.hostile import cli, label, make_cache, make_decoy, namespace_of, time_bound, tree_digest
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.store import STRIDE, config, exact, seq

NAMESPACE_FILES = {"namespace.json"}  # the rest sit in the writer's segment


@pytest.fixture
def cache(tmp_path):
    """(cache root, its one writer's segment directory, a decoy tree outside the root)."""
    root = tmp_path / "cache"
    return root, make_cache(root), make_decoy(tmp_path / "decoy")


def where(segment, name):
    """The path of kvtier's entry ``name``: in the namespace directory or the segment."""
    return (namespace_of(segment) if name in NAMESPACE_FILES else segment) / name


def data(code_output):
    code, output = code_output
    return code, json.loads(output[output.index("{"):])


# -- deleting what kvtier did not write ------------------------------------------


def test_clear_and_gc_leave_directories_kvtier_did_not_write(cache):
    root, segment, _ = cache
    ns = namespace_of(segment)
    mine = root / "my-project"
    mine.mkdir()
    (mine / "namespace.json").write_text("{}")
    (mine / "slots-0001.kvt").write_bytes(b"mine")
    fake = root / ("ab" * 16)  # a namespace-like name whose metadata is not kvtier's
    fake.mkdir(mode=0o700)
    (fake / "namespace.json").write_text(json.dumps({"namespace": "{}", "stride": 8192,
                                                     "raw_bytes": 4096, "file_slots": 1}))
    (fake / "notes.txt").write_text("keep me")
    before = tree_digest(mine), tree_digest(fake)
    code, report = data(cli("gc", root, "--stale", "--json"))
    assert code == 0 and not report["namespaces_removed"]  # damaged metadata: not stale
    code, report = data(cli("clear", root, "--yes", "--json"))
    assert code == 1 and report["removed"] == [ns.name] and fake.name in report["left"]
    assert (tree_digest(mine), tree_digest(fake)) == before and not ns.exists()


def test_clear_removes_only_kvtier_files_of_a_segment(cache):
    root, segment, _ = cache
    (segment / "operator-notes.txt").write_text("keep me")
    code, report = data(cli("clear", root, "--yes", "--json"))
    assert code == 1 and report["left"] == {label(segment): ["operator-notes.txt"]}
    assert sorted(p.name for p in segment.iterdir()) == ["operator-notes.txt"]
    assert (namespace_of(segment) / "namespace.json").exists()  # it describes what is left


def test_clear_removes_only_kvtier_files_of_a_namespace(cache):
    root, segment, _ = cache
    ns = namespace_of(segment)
    (ns / "operator-notes.txt").write_text("keep me")
    code, report = data(cli("clear", root, "--yes", "--json"))
    assert code == 1 and report["left"] == {ns.name: ["operator-notes.txt"]}
    assert report["segments_removed"] == [label(segment)]
    assert sorted(p.name for p in ns.iterdir()) == ["operator-notes.txt"]


@pytest.mark.parametrize("name", ["not a writer!", "-dash", ".hidden", "x" * 65])
@pytest.mark.parametrize("kind", ["directory", "file"])
def test_entries_of_writers_that_are_no_writer_id_are_left_alone(cache, name, kind):
    root, segment, _ = cache
    odd = segment.parent / name
    if kind == "directory":
        odd.mkdir()
        for file in ("slots-0000.kvt", "index.kvt", "lock", "lease"):
            (odd / file).write_bytes(b"not kvtier's")
    else:
        odd.write_bytes(b"not kvtier's")
    mode = odd.stat().st_mode
    code, report = data(cli("inspect", root, "--json"))
    (found,) = report["namespaces"]
    assert code == 0 and found["ignored"] == [name] and len(found["writers"]) == 1
    assert "not a writer's segment" in cli("inspect", root)[1]
    odd_before = tree_digest(odd) if kind == "directory" else odd.read_bytes()
    code, report = data(cli("clear", root, "--yes", "--json"))
    ns = namespace_of(segment).name
    assert code == 1 and report["left"] == {f"{ns}/writers": [name]}
    assert report["segments_removed"] == [label(segment)] and not segment.exists()
    assert sorted(p.name for p in segment.parent.iterdir()) == [name]
    assert odd.stat().st_mode == mode
    assert (tree_digest(odd) if kind == "directory" else odd.read_bytes()) == odd_before


def test_an_empty_path_is_refused_not_the_current_directory(cache):
    root, segment, _ = cache
    result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "clear", "", "--yes"],
                            cwd=root, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "PATH is empty" in result.stderr
    assert segment.exists()


# -- writing outside the root through symlinks -----------------------------------

ALL_COMMANDS = (["inspect"], ["verify"], ["verify", "--repair"], ["gc", "--older-than", "0s"],
                ["gc", "--stale"], ["clear", "--yes"])


def every_command(root):
    for args in ALL_COMMANDS:
        cli(args[0], root, *args[1:])


@pytest.mark.parametrize("name", ["namespace.json", "index.kvt", "slots-0000.kvt", "lock",
                                  "lease", "log.kvt", ".o_direct_probe"])
def test_a_symlink_in_a_namespace_never_leads_outside(cache, name):
    root, segment, decoy = cache
    target = decoy / "precious.txt"
    path = where(segment, name)
    if path.exists():
        path.unlink()
    path.symlink_to(target)
    before = tree_digest(decoy)
    with KVStore(SMALL, config(root)) as store:
        store.put(seq(500, 2), make_kv(seq(500, 2)))
        store.flush()
        exact(store, seq(500, 2))
        if name in ("index.kvt", "slots-0000.kvt", "lock"):
            (reason,) = store.disk.down_paths.values()
            assert "symlink" in reason
    every_command(root)
    assert tree_digest(decoy) == before and oct(target.stat().st_mode)[-3:] == "644"


@pytest.mark.parametrize("level", ["namespace", "writers", "segment"])
def test_a_symlinked_directory_is_never_opened(cache, level):
    root, segment, decoy = cache
    directory = {"namespace": namespace_of(segment), "writers": segment.parent,
                 "segment": segment}[level]
    before = tree_digest(decoy)
    os.rename(directory, root.parent / "moved")
    directory.symlink_to(decoy / "dir")
    with KVStore(SMALL, config(root)) as store:
        assert "symlink" in next(iter(store.disk.down_paths.values()))
    code, report = data(cli("inspect", root, "--json"))
    if level != "namespace":  # a link in place of a namespace is no namespace at all
        (found,) = report["namespaces"]
        assert code == 1 and found["status"] == "unsafe" and "symlink" in found["problem"]
    every_command(root)
    assert tree_digest(decoy) == before and directory.is_symlink()


def test_hard_links_to_files_elsewhere_are_refused(cache):
    root, segment, decoy = cache
    (segment / "index.kvt").unlink()
    os.link(decoy / "precious.txt", segment / "index.kvt")
    before = tree_digest(decoy)
    with KVStore(SMALL, config(root)) as store:
        assert "hard links" in next(iter(store.disk.down_paths.values()))
    cli("verify", root, "--repair")
    cli("clear", root, "--yes")
    assert tree_digest(decoy) == before


# -- verify --repair on edited metadata ------------------------------------------


def edit_meta(ns, **changes):
    meta = json.loads((ns / "namespace.json").read_text())
    (ns / "namespace.json").write_text(json.dumps({**meta, **changes}))


def recovered(root):
    with KVStore(SMALL, config(root)) as store:
        return store.stats().recovered_chunks


def test_repair_never_blanks_slots_when_the_stride_was_edited(cache):
    root, segment, _ = cache
    slots = (segment / "slots-0000.kvt").read_bytes()
    edit_meta(namespace_of(segment), stride=2 * STRIDE)
    code, report = data(cli("verify", root, "--repair", "--json"))
    assert code == 1 and "stride" in report["namespaces"][0]["problem"]
    assert (segment / "slots-0000.kvt").read_bytes() == slots and recovered(root) == 3


def test_repair_refuses_when_slots_disagree_with_the_metadata(cache):
    root, segment, _ = cache
    ns = namespace_of(segment)
    slots = (segment / "slots-0000.kvt").read_bytes()
    raw = json.loads((ns / "namespace.json").read_text())["raw_bytes"]
    edit_meta(ns, raw_bytes=raw + 4096, stride=STRIDE + 4096,  # consistent, but wrong
              file_slots=(8 << 30) // (STRIDE + 4096))
    code, report = data(cli("verify", root, "--repair", "--json"))
    (found,) = report["namespaces"][0]["writers"]
    assert code == 1 and found["mismatched"] and "not repaired" in found["problem"]
    assert (segment / "slots-0000.kvt").read_bytes() == slots and recovered(root) == 3


# -- special files where kvtier expects its own ---------------------------


@pytest.mark.parametrize("name", ["lock", "index.kvt", "namespace.json", "slots-0000.kvt",
                                  "lease", "log.kvt"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_7_special_files_never_block_and_take_the_path_out(cache, name, kind):
    root, segment, _ = cache
    path = where(segment, name)
    if path.exists():
        path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with time_bound(30, "KVStore()"), KVStore(SMALL, config(root)) as store:
        store.put(seq(800, 1), make_kv(seq(800, 1)))
        assert exact(store, seq(800, 1)) == 16
        down = store.disk.down_paths
    if name in ("namespace.json", "lease", "log.kvt") and kind == "fifo":
        assert not down  # replaced by a real file, atomically
    else:
        assert down and ("FIFO" in str(down) or "directory" in str(down))
    every_command(root)


# -- malformed metadata and names ------------------------------------------------


@pytest.mark.parametrize("meta", ["[1, 2]", '{"stride": 0}', '{"stride": "abc"}', "{}",
                                  "not json", '{"namespace": "[]"}', "\xff\xfe"])
def test_malformed_metadata_is_a_clean_report(cache, meta):
    root, segment, _ = cache
    (namespace_of(segment) / "namespace.json").write_bytes(meta.encode("latin-1"))
    code, report = data(cli("inspect", root, "--json"))
    (found,) = report["namespaces"]
    assert code == 1 and found["status"] == "damaged" and len(found["writers"]) == 1
    assert cli("verify", root)[0] == 1
    assert cli("verify", root, "--repair")[0] == 1
    assert cli("gc", root, "--stale", "--older-than", "0s")[0] == 0
    assert len(list(segment.glob("slots-*.kvt"))) == 1  # damaged metadata is no reason to delete


def test_odd_names_and_kinds_are_clean(cache):
    root, segment, _ = cache
    (root / "not-hex-at-all").mkdir()
    (root / "not-hex-at-all" / "namespace.json").write_text("{}")
    (segment / "slots-abc.kvt").write_bytes(b"x")
    (segment / "index.kvt").unlink()
    (segment / "index.kvt").mkdir()
    _code, report = data(cli("inspect", root, "--json"))
    assert [n["id"] for n in report["namespaces"]] == [namespace_of(segment).name]
    for args in (["verify", root], ["verify", root, "--repair"], ["gc", root, "--older-than", "0s"],
                 ["clear", root, "--yes"]):
        cli(*args)
    assert (root / "not-hex-at-all" / "namespace.json").exists()
    assert (segment / "slots-abc.kvt").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("name", ["slots-0000.kvt", "index.kvt", "lease", "log.kvt", "lock"])
def test_another_users_file_in_a_segment_is_never_used_nor_deleted(cache, name):
    root, segment, _ = cache
    os.chown(segment / name, 4242, 4242)
    content = (segment / name).read_bytes()
    for args in ALL_COMMANDS:
        cli(args[0], root, *args[1:])
    assert (segment / name).read_bytes() == content and (segment / name).stat().st_uid == 4242


# -- bounded reads ---------------------------------------------------------------


def test_a_huge_sparse_index_is_not_read_whole(cache):
    root, segment, _ = cache
    os.truncate(segment / "index.kvt", 8 << 30)
    # VmHWM, not ru_maxrss: after a vfork and exec, ru_maxrss starts at the parent's peak
    # (pytest's, over 1 GiB late in a full run), VmHWM at this process's own.
    code = ("import re; from typer.testing import CliRunner; "
            "from kvtier.cli.main import app; "
            f"r = CliRunner().invoke(app, ['inspect', {str(root)!r}, '--json']); "
            "status = open('/proc/self/status').read(); "
            "print(r.exit_code, re.search(r'VmHWM:\\s+(\\d+) kB', status)[1])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    exit_code, max_rss_kib = map(int, result.stdout.split()[-2:])
    assert exit_code == 0 and max_rss_kib < 1 << 20, result.stdout  # under 1 GiB, not 8


def test_verify_of_a_huge_sparse_slot_file_is_bounded(cache):
    root, segment, _ = cache
    os.truncate(segment / "slots-0000.kvt", 100 << 30)
    code, report = data(cli("verify", root, "--json", bound=60))
    (found,) = report["namespaces"][0]["writers"]
    assert code == 0 and found["ok"] == 3 and found["slots"] * STRIDE <= (8 << 30) + STRIDE


def test_a_disk_too_large_to_track_is_a_config_error(tmp_path):
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="raise chunk_tokens or lower disk_capacity"):
        KVStore(SMALL, config(tmp_path, disk_chunks=1, disk_capacity="1TiB"))


# -- exit codes and figures -----------------------------------------------------


def test_inspect_of_a_truncated_slot_file_is_at_most_full(cache):
    root, segment, _ = cache
    os.truncate(segment / "slots-0000.kvt", STRIDE)
    code, report = data(cli("inspect", root, "--json"))
    (found,) = report["namespaces"]
    assert code == 0 and found["slots"] == 1 and found["chunks"] <= 1 and found["fill"] <= 1.0
    assert found["bad_index_entries"] == 2 and found["writers"][0]["bad_index_entries"] == 2


def old_namespace(root, files=()):
    """A namespace of an older format version, laid out as version 1 did: its files directly
    in the namespace directory."""
    described = json.dumps({"format_version": 1, "model": "old"})
    old = root / namespace_id_of(described)
    old.mkdir(mode=0o700)
    (old / "namespace.json").write_text(json.dumps({"namespace": described, "stride": 8192,
                                                    "raw_bytes": 4096, "file_slots": 10}))
    for name in files:
        (old / name).write_bytes(bytes(8192))
    return old


def test_a_stale_namespace_proven_by_its_metadata_is_reclaimed(cache):
    root, _segment, _ = cache
    old = old_namespace(root)
    code, report = data(cli("gc", root, "--stale", "--json"))
    assert code == 0 and report["namespaces_removed"] == [old.name] and not old.exists()
    assert recovered(root) == 3


@pytest.mark.parametrize("name", ["lock", "slots-0000.kvt", "index.kvt", "namespace.json"])
def test_a_symlink_in_a_stale_namespace_is_left_alone(cache, name):
    root, _segment, decoy = cache
    old = old_namespace(root, ["lock", "slots-0000.kvt", "index.kvt"])
    (old / name).unlink()
    (old / name).symlink_to(decoy / "precious.txt")
    before = tree_digest(decoy)
    code, report = data(cli("gc", root, "--stale", "--json"))
    if name == "namespace.json":  # no namespace.json to trust, nor a slot proving it kvtier's
        assert code == 1 and old.name in report["skipped_unsafe"]
    else:
        assert code == 1 and old.name in report["left"] and not report["namespaces_removed"]
    assert (old / name).is_symlink() and tree_digest(decoy) == before
    cli("clear", root, "--yes")
    assert (old / name).is_symlink() and tree_digest(decoy) == before


def test_a_namespace_without_metadata_is_reclaimed_only_when_a_slot_proves_it(cache, tmp_path):
    root, segment, _ = cache
    ns = namespace_of(segment)
    (ns / "namespace.json").unlink()
    fake = root / ("ef" * 16) / "writers" / "w-0"  # slot files no header of which names it
    fake.mkdir(parents=True, mode=0o700)
    (fake / "slots-0000.kvt").write_bytes(bytes(2 * STRIDE))
    code, report = data(cli("inspect", root, "--json"))
    assert code == 0 and {n["status"] for n in report["namespaces"]} == {"orphaned"}
    code, report = data(cli("gc", root, "--stale", "--json"))
    assert code == 1 and report["namespaces_removed"] == [ns.name] and not ns.exists()
    assert report["skipped_unsafe"] == [fake.parent.parent.name] and fake.exists()


def test_a_fresh_lease_of_another_machine_keeps_its_segment(cache):
    import time

    from kvtier.segment.lease import LeaseInfo

    root, segment, _ = cache
    lease = LeaseInfo("w", "elsewhere", 1, 7, time.time_ns(), time.time_ns())
    (segment / "lease").write_bytes(lease.encode())
    code, report = data(cli("inspect", root, "--json"))
    (writer,) = report["namespaces"][0]["writers"]
    assert writer["in_use"] and writer["host"] == "elsewhere" and writer["beat"] == 7
    code, report = data(cli("gc", root, "--older-than", "0s", "--json"))
    assert code == 1 and report["skipped_in_use"] == [label(segment)]
    code, report = data(cli("verify", root, "--repair", "--json"))
    assert code == 1 and "elsewhere" in report["namespaces"][0]["writers"][0]["problem"]
    code, report = data(cli("clear", root, "--yes", "--json"))
    assert code == 1 and report["in_use"] == [label(segment)] and segment.exists()
    written = time.time_ns() - 3600 * 10**9  # an hour ago, after 6 beats in 0.6 s
    old = LeaseInfo("w", "elsewhere", 1, 7, written - 6 * 10**8, written)
    (segment / "lease").write_bytes(old.encode())
    os.utime(segment / "lease", ns=(written, written))  # by the filesystem's clock
    code, report = data(cli("clear", root, "--yes", "--json"))
    assert code == 0 and not segment.exists()


@pytest.mark.parametrize(("host", "beats", "every_s", "age_s", "live", "stated_s"), [
    ("elsewhere", 2, 5, 100, True, 0), ("elsewhere", 2, 5, 130, False, 0),  # the 120 s floor
    ("elsewhere", 10, 60, 300, True, 0), ("elsewhere", 10, 60, 400, False, 0),  # six beats
    ("elsewhere", 1, 0, 119, True, 0), ("elsewhere", 1, 0, 121, False, 0),
    (None, 2, 5, 1, False, 0),  # this machine: its lock says
    ("elsewhere", 1, 0, 590, True, 600), ("elsewhere", 1, 0, 610, False, 600),  # stated
    ("elsewhere", 1, 0, 86_390, True, 10**9), ("elsewhere", 1, 0, 86_410, False, 10**9),
    ("elsewhere", 2, 10**9, 86_410, False, 0),  # beats a forged lease claims: a day at most
])
def test_a_lease_of_another_machine_counts_for_six_of_its_heartbeats(host, beats, every_s,
                                                                      age_s, live, stated_s):
    from kvtier.segment.lease import LeaseInfo
    from kvtier.segment.lease_age import held_elsewhere
    from kvtier.segment.names import host_name

    written = 10**18  # by the writer's clock: its heartbeat intervals, never its age
    started = written - (beats - 1) * every_s * 10**9
    lease = LeaseInfo("w", host or host_name(), 1, beats, started, written, 0, stated_s * 1000)
    assert bool(held_elsewhere(lease, age_s)) is live  # age_s: by the filesystem's clock
    assert bool(held_elsewhere(lease, None)) is (host is not None)  # an age not known: live


def test_a_disk_path_that_is_a_symlink_to_a_directory_is_named_a_symlink(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with KVStore(SMALL, config(link)) as store:
        (reason,) = store.disk.down_paths.values()
    assert f"{link} is a symlink" in reason and "not a directory" not in reason
    assert not any(real.iterdir())  # nothing written through the link


@pytest.mark.parametrize("what", ["namespace symlink", "namespace file", "seats symlink"])
def test_a_namespace_an_engine_would_take_out_of_service_is_reported_unsafe(cache, tmp_path, what):
    """A namespace directory swapped for a symlink or a file, or its ``seats`` for a
    symlink: an engine takes the disk path out of service; inspect and verify said all was
    well (no namespace at all, or ok) and exited 0 (a review). Nothing is removed."""
    root, segment, _ = cache
    ns = namespace_of(segment)
    if what == "namespace symlink":
        moved = tmp_path / "elsewhere"
        ns.rename(moved)
        ns.symlink_to(moved)
    elif what == "namespace file":
        shutil.rmtree(ns)
        ns.write_bytes(b"")
    else:
        seats = ns / "seats"
        if seats.exists():
            shutil.rmtree(seats)
        seats.symlink_to(tmp_path)
    for command in ("inspect", "verify"):
        code, report = data(cli(command, root, "--json"))
        (found,) = report["namespaces"]
        assert code == 1 and found["id"] == ns.name, (command, report)
        assert "out of service" in json.dumps(found), (command, found)
    code, report = data(cli("gc", root, "--stale", "--json"))
    assert ns.is_symlink() or ns.exists()
