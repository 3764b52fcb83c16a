"""The offline commands read the filesystem's clock (a probe file's change time) only in a
namespace directory kvtier provably wrote, never in a segment directory nor in a namespace
directory not proven kvtier's; where no file can be made (a read-only mount) they still work,
and say that the clock was not read and what that means for lease ages."""

import errno
import json
import os
import shutil
import time
import uuid

import pytest

from kvtier.io.safefs import SafeDir
from kvtier.segment import machine
from kvtier.segment.lease import LeaseInfo
from tests.helpers.hostile import cli, label, make_cache, namespace_of

OTHER_BOOT = str(uuid.UUID(int=uuid.UUID(machine.boot_id()).int ^ 1))  # another kernel's
FILE_AGE_S = 15 * 60


def lease_elsewhere(segment, file_age_s: float = FILE_AGE_S) -> None:
    """The lease of a writer on another machine, left open, its file last written
    ``file_age_s`` ago by the filesystem's clock (its stated time: now)."""
    now, every = time.time_ns(), 10**8
    lease = LeaseInfo(segment.name, "nodeB", 4242, 500, now - 499 * every, now, 1, 600, 0, 1,
                      OTHER_BOOT)
    (segment / "lease").write_bytes(lease.encode())
    written = time.time_ns() - int(file_age_s * 10**9)
    os.utime(segment / "lease", ns=(written, written))


def report(*args):
    code, output = cli(*args, "--json")
    return code, json.loads(output[output.index("{"):])


@pytest.fixture
def probes(monkeypatch):
    """The directories a clock probe file is made in."""
    made = []
    real = SafeDir.open_file

    def open_file(self, name, flags, *, create=False):
        if create and name.startswith(".clock_probe"):
            made.append(self.path)
        return real(self, name, flags, create=create)

    monkeypatch.setattr(SafeDir, "open_file", open_file)
    return made


@pytest.fixture
def cache(tmp_path):
    """A namespace kvtier wrote (its writer on another machine, gone by file times), and two
    copies of it under other ids: one whose namespace.json describes another namespace
    (damaged), one without namespace.json (orphaned, and no slot names it)."""
    root = tmp_path / "cache"
    segment = make_cache(root, instance_id="nodeB-0")
    lease_elsewhere(segment)
    proven = namespace_of(segment)
    damaged, orphaned = root / ("d" * 32), root / ("0" * 32)
    for copy in (damaged, orphaned):
        shutil.copytree(proven, copy, symlinks=True)
        lease_elsewhere(copy / "writers" / segment.name)
    (orphaned / "namespace.json").unlink()
    return root, proven, damaged, orphaned


COMMANDS = [("inspect",), ("verify",), ("verify", "--repair"), ("gc", "--older-than", "100d"),
            ("gc", "--gone", "1h", "--dry-run"), ("gc", "--stale", "--dry-run"),
            ("clear", "--yes", "--namespace", "d" * 32), ("clear", "--yes", "--namespace", "0" * 32)]


def test_the_clock_is_read_only_in_a_namespace_directory_kvtier_provably_wrote(cache, probes):
    root, proven, damaged, orphaned = cache
    for command in COMMANDS:
        report(command[0], root, *command[1:])
        assert set(probes) <= {str(proven)}, (command, probes)
        probes.clear()
    code, found = report("inspect", root)
    by_id = {n["id"]: n for n in found["namespaces"]}
    assert by_id[proven.name]["clock_problem"] == ""
    assert by_id[proven.name]["writers"][0]["lease_age_seconds"] >= FILE_AGE_S - 1
    for other in (damaged, orphaned):
        ns = by_id[other.name]
        assert ns["writers"][0]["lease_age_seconds"] is None and ns["writers"][0]["in_use"]
        assert f"{other} is not proven kvtier's" in ns["clock_problem"], ns
    assert damaged.exists() and orphaned.exists()
    code, gone = report("gc", root, "--gone", "10m", "--namespace", proven.name)
    assert code == 0 and gone["segments_removed"] == [f"{proven.name}/writers/nodeB-0"]


def test_a_namespace_proven_by_its_slots_is_dated_once_proven(tmp_path, probes):
    """Without namespace.json, a namespace whose slots name it is proven kvtier's before
    ``gc --stale`` removes it: its clock is read then, so a writer elsewhere gone by file
    times does not hold it."""
    root = tmp_path / "cache"
    segment = make_cache(root, instance_id="nodeB-0")
    lease_elsewhere(segment)
    ns = namespace_of(segment)
    (ns / "namespace.json").unlink()
    code, gone = report("gc", root, "--stale")
    assert code == 0 and gone["namespaces_removed"] == [ns.name] and not ns.exists(), gone
    assert probes and set(probes) == {str(ns)}


def read_only(monkeypatch):
    """From now on no file can be made, nor opened for writing, anywhere (as on a read-only
    mount)."""
    real = SafeDir.open_file

    def open_file(self, name, flags, *, create=False):
        if create or flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(self, name, flags, create=create)

    monkeypatch.setattr(SafeDir, "open_file", open_file)


def test_where_no_file_can_be_made_the_commands_work_and_say_so(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    segment = make_cache(root, instance_id="nodeB-0")
    lease_elsewhere(segment)
    read_only(monkeypatch)
    ns = namespace_of(segment)
    why = f"no file can be made in {ns} (Read-only file system)"
    code, found = report("inspect", root)
    (namespace,) = found["namespaces"]
    (writer,) = namespace["writers"]
    assert code == 0 and why in namespace["clock_problem"], namespace
    assert writer["lease_age_seconds"] is None and writer["in_use"]  # as before: not dated
    assert why in " ".join(cli("inspect", root)[1].split())
    code, checked = report("verify", root)
    assert code == 0 and checked["problems"] == 0 and why in checked["namespaces"][0]["clock_problem"]
    assert why in " ".join(cli("verify", root)[1].split())
    code, gone = report("gc", root, "--gone", "10m")
    assert code == 1 and gone["skipped_in_use"] == [label(segment)] and segment.exists()
    assert "cannot be dated" in gone["reasons"][label(segment)]
    assert why in gone["reasons"][label(segment)]


def test_on_a_read_only_mount_a_lock_held_is_told_from_one_not_held(tmp_path, monkeypatch):
    """A lock file cannot be opened for writing there: it is looked at open for reading, so
    a segment no process holds is not in use, and one a process of this host holds is."""
    from kvtier import KVStore
    from tests.helpers.kv import SMALL
    from tests.helpers.store import config

    root = tmp_path / "cache"
    make_cache(root, instance_id="a")
    with KVStore(SMALL, config(root, instance_id="b", share_writers=4)):
        read_only(monkeypatch)
        code, found = report("inspect", root)
        in_use = {w["writer"]: w["in_use"] for w in found["namespaces"][0]["writers"]}
        assert code == 0 and in_use == {"a": False, "b": True}, found
        code, checked = report("verify", root)
        in_use = {w["writer"]: w["in_use"] for w in checked["namespaces"][0]["writers"]}
        assert code == 0 and in_use == {"a": False, "b": True}, checked
