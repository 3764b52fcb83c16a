"""``kvtier gc --gone`` where no file can be made to read the filesystem's clock (a full
disk, an inode quota: when gc is needed most): a segment this machine's writer left is
dated by the time its lease states, on this machine's clock, and removed once gone; one
another machine left cannot be dated, and is reported as in use, never passed over
silently."""

import errno
import json
import os
import time

import pytest
from typer.testing import CliRunner

from kvtier import KVStore
from kvtier.cli.main import app
from kvtier.io.safefs import SafeDir
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.store import config, seq

HOURS_2 = 2 * 3600 * 10**9


@pytest.fixture
def gone(tmp_path):
    """A segment whose writer stopped two hours ago (by its lease's file time and stated time)."""
    with KVStore(SMALL, config(tmp_path, instance_id="a")) as store:
        store.put(seq(0, 2), make_kv(seq(0, 2)))
        store.flush()
    (segment,) = tmp_path.glob("*/writers/a")
    return tmp_path, segment


def age(segment, **fields) -> None:
    old = time.time_ns() - HOURS_2
    lease = json.loads((segment / "lease").read_text())
    lease.update(written_ns=old, started_ns=old - 10**9, **fields)
    (segment / "lease").write_text(json.dumps(lease))
    os.utime(segment / "lease", ns=(old, old))


@pytest.fixture
def full_disk(monkeypatch):
    real = SafeDir.open_file

    def open_file(self, name, flags, *, create=False):
        if create and name.startswith(".clock_probe"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, name, flags, create=create)

    monkeypatch.setattr(SafeDir, "open_file", open_file)


def gc_gone(root):
    result = CliRunner().invoke(app, ["gc", str(root), "--gone", "1h", "--json"])
    return result.exit_code, json.loads(result.stdout[result.stdout.index("{"):])


def test_this_machines_gone_writer_is_removed_by_its_stated_time(gone, full_disk):
    root, segment = gone
    age(segment)
    code, report = gc_gone(root)
    assert code == 0 and report["segments_removed"] and not segment.exists()


def test_another_machines_writer_that_cannot_be_dated_is_reported_in_use(gone, full_disk):
    root, segment = gone
    age(segment, host="elsewhere", boot_id="00000000-0000-0000-0000-000000000001", closed_ns=0)
    code, report = gc_gone(root)
    assert code == 1 and segment.exists() and report["skipped_in_use"]
    assert "cannot be dated" in json.dumps(report)


def test_a_lease_of_this_host_name_and_another_boot_is_not_dated_by_its_stated_time(
        gone, full_disk, monkeypatch):
    """This host before a reboot, or another machine of its name whose writer cannot beat on
    the full disk: which, cannot be told without the filesystem's clock, and that machine's
    stated time is by its own clock. It counts as in use."""
    from kvtier.segment import lease_age

    root, segment = gone
    age(segment, boot_id="00000000-0000-0000-0000-000000000001", closed_ns=0)
    monkeypatch.setattr(lease_age, "uptime_s", lambda: 600.0)  # booted after its last beat
    code, report = gc_gone(root)
    assert code == 1 and segment.exists() and report["skipped_in_use"]
