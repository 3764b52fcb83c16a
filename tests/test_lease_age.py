"""A lease of another machine is judged by file times: its file's modification time against the
time now on the filesystem's clock (a file made for the purpose), never by the time the lease
states, which is its writer's clock. A live writer whose clock runs behind keeps its segment;
a stopped one whose clock ran ahead is gone all the same."""

import errno
import json
import os
import time
import uuid

from kvtier import KVStore
from kvtier.io.safefs import SafeDir
from kvtier.segment import lease_age, machine
from kvtier.segment.lease import LeaseInfo
from kvtier.segment.names import TEMP_NAME
from tests.helpers.hostile import cli, label, make_cache
from tests.helpers.kv import SMALL
from tests.helpers.store import config

MINUTE = 60 * 10**9
OTHER_BOOT = str(uuid.UUID(int=uuid.UUID(machine.boot_id()).int ^ 1))  # another kernel's


def write_lease(segment, clock_ns, every_s=0.1, file_age_s=0.0):
    """The lease of a writer on another machine, beating every ``every_s`` by a clock that
    reads ``clock_ns`` now, last written ``file_age_s`` ago by the filesystem's clock."""
    every = int(every_s * 10**9)
    lease = LeaseInfo(segment.name, "nodeB", 4242, 500, clock_ns - 499 * every, clock_ns, 1,
                      round(every_s * 6000), 0, 1, OTHER_BOOT)
    (segment / "lease").write_bytes(lease.encode())
    written = time.time_ns() - int(file_age_s * 10**9)
    os.utime(segment / "lease", ns=(written, written))


def report(*args):
    code, output = cli(*args, "--json")
    return code, json.loads(output[output.index("{"):])


def test_a_live_writer_elsewhere_whose_clock_runs_behind_keeps_its_segment(tmp_path):
    root = tmp_path / "cache"
    segment = make_cache(root, instance_id="nodeB-0")
    write_lease(segment, time.time_ns() - 15 * MINUTE, every_s=20)  # just written
    code, found = report("inspect", root)
    (writer,) = found["namespaces"][0]["writers"]
    assert writer["in_use"] and 0 <= writer["lease_age_seconds"] < 60, writer
    code, gone = report("gc", root, "--gone", "10m")
    assert gone["segments_removed"] == [] and segment.exists()
    code, freed = report("gc", root, "--older-than", "0s")
    assert code == 1 and freed["skipped_in_use"] == [label(segment)] and freed["chunks_freed"] == 0
    code, cleared = report("clear", root, "--yes")
    assert code == 1 and cleared["in_use"] == [label(segment)] and segment.exists()
    with KVStore(SMALL, config(root, instance_id="nodeB-0", share_writers=4)) as again:
        (reason,) = again.stats().paths_down.values()
    assert "in use on another machine" in reason and "nodeB (pid 4242)" in reason


def test_a_stopped_writer_elsewhere_whose_clock_ran_ahead_is_gone(tmp_path):
    root = tmp_path / "cache"
    segment = make_cache(root, instance_id="nodeB-0")
    write_lease(segment, time.time_ns(), file_age_s=15 * 60)  # its time looks current
    code, found = report("inspect", root)
    (writer,) = found["namespaces"][0]["writers"]
    assert not writer["in_use"] and writer["lease_age_seconds"] >= 15 * 60 - 1
    code, gone = report("gc", root, "--gone", "10m")
    assert code == 0 and gone["segments_removed"] == [label(segment)] and not segment.exists()


def test_where_the_filesystems_clock_cannot_be_read_a_lease_elsewhere_holds(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    segment = make_cache(root, instance_id="nodeB-0")
    write_lease(segment, time.time_ns(), file_age_s=15 * 60)
    real = SafeDir.open_file

    def read_only(self, name, flags, *, create=False):
        if create:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(self, name, flags, create=create)

    monkeypatch.setattr(SafeDir, "open_file", read_only)
    with SafeDir.open(segment) as directory:
        assert lease_age.filesystem_now_ns(directory) is None
        reason = lease_age.remote_holder(directory)
    assert "nodeB (pid 4242)" in reason and "age cannot be told" in reason


def test_the_clock_probe_leaves_nothing_behind_and_a_leftover_is_kvtiers(tmp_path):
    root = tmp_path / "cache"
    segment = make_cache(root, instance_id="nodeB-0")
    write_lease(segment, time.time_ns())
    before = sorted(p.name for p in root.rglob("*"))
    with SafeDir.open(segment) as directory:
        now = lease_age.filesystem_now_ns(directory)
    assert abs(now - time.time_ns()) < MINUTE  # a local disk: this kernel's clock
    report("inspect", root)
    assert sorted(p.name for p in root.rglob("*")) == before
    assert TEMP_NAME.fullmatch(f".clock_probe-{os.getpid()}-0badc0de")
