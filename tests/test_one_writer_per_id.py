"""One writer id, one writer, also where ``flock`` is not passed on between machines: a
segment whose lease shows a live writer on another machine is not opened, a writer whose
lease another process rewrote takes its path out, and a closed segment is free at once."""

import os
import time

import pytest

from kvtier import KVStore
from kvtier.io.safefs import SafeDir
from kvtier.segment import cachedir
from kvtier.segment.lease import LeaseInfo, read_lease
from kvtier.segment.lease_age import held_elsewhere
from kvtier.segment.names import LOCK_FILE
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.shared import wait_for
from tests.helpers.store import config, exact, seq


def segment_of(tmp_path, writer):
    (segment,) = tmp_path.glob(f"*/writers/{writer}")
    return segment


def lease_of(tmp_path, writer):
    with SafeDir.open(segment_of(tmp_path, writer)) as directory:
        return read_lease(directory)


def test_a_closed_store_says_so_in_its_lease(tmp_path):
    tokens = seq(0, 2)
    with KVStore(SMALL, config(tmp_path, instance_id="a")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
        assert lease_of(tmp_path, "a").closed_ns == 0
    closed = lease_of(tmp_path, "a")
    assert closed.closed_ns >= closed.started_ns > 0
    elsewhere = LeaseInfo("a", "elsewhere", 1, 9, time.time_ns(), time.time_ns())
    assert held_elsewhere(elsewhere, 0.0) and not held_elsewhere(
        LeaseInfo(**{**elsewhere.__dict__, "closed_ns": time.time_ns()}), 0.0)


def test_a_segment_another_machine_writes_is_not_opened_under_its_id(tmp_path):
    tokens = seq(0, 2)
    with KVStore(SMALL, config(tmp_path, instance_id="a")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
    lease = segment_of(tmp_path, "a") / "lease"
    now = time.time_ns()
    lease.write_bytes(LeaseInfo("a", "elsewhere", 77, 9, now - 10**9, now).encode())
    with KVStore(SMALL, config(tmp_path, instance_id="a")) as again:
        (reason,) = again.stats().paths_down.values()
        assert "in use on another machine" in reason and "elsewhere (pid 77)" in reason
        assert "instance_id" in reason
    assert LeaseInfo.parse(lease.read_bytes()).host == "elsewhere"  # left as it was
    lease.write_bytes(LeaseInfo("a", "elsewhere", 77, 9, now - 10**9, now, 0, 0, now).encode())
    with KVStore(SMALL, config(tmp_path, instance_id="a")) as again:  # closed there: free
        assert not again.stats().paths_down and exact(again, tokens) == 2 * CHUNK


def test_a_lease_dated_far_ahead_holds_no_segment_and_gc_finds_it_gone(tmp_path):
    """A lease file dated days ahead (a forged time, or a client whose clock ran that far
    ahead where clients set file times), its writer since gone: it would hold the segment
    until the clock caught up. Within ``REMOTE_LEASE_S`` ahead it still shows a live writer."""
    from tests.helpers.cli import as_json

    day, now = 86400, time.time_ns()
    lease = LeaseInfo("a", "elsewhere", 1, 7, now - 6 * 10**8, now, 0, 600)
    assert held_elsewhere(lease, -30.0) and not held_elsewhere(lease, -3.0 * day)
    tokens = seq(0, 2)
    with KVStore(SMALL, config(tmp_path, instance_id="a")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
    path = segment_of(tmp_path, "a") / "lease"
    path.write_bytes(lease.encode())
    ahead = now + 3 * day * 10**9
    os.utime(path, ns=(ahead, ahead))
    code, report = as_json("gc", tmp_path, "--gone", "1h")
    assert code == 0 and len(report["segments_removed"]) == 1, report


def test_two_writers_on_one_id_without_a_shared_lock_leave_one_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(cachedir, "lock_namespace",  # a filesystem without flock between hosts
                        lambda directory, advice: directory.open_file(LOCK_FILE, os.O_RDWR,
                                                                      create=True))
    tokens = seq(0, 2)
    quick = config(tmp_path, instance_id="a", lease_timeout="2s")
    with KVStore(SMALL, quick) as first:
        first.put(tokens, make_kv(tokens))
        first.flush()
        with KVStore(SMALL, quick) as second:  # the same id, taken again by another process
            wait_for(lambda: bool(first.stats().paths_down), timeout=5)
            (reason,) = first.stats().paths_down.values()
            assert "under the same writer id" in reason and "instance_id" in reason
            time.sleep(1)  # several of second's heartbeats: its lease is its own
            assert not second.stats().paths_down
            assert exact(second, tokens) == 2 * CHUNK
            mine = lease_of(tmp_path, "a")
        assert lease_of(tmp_path, "a").closed_ns and mine.closed_ns == 0


def test_a_heartbeat_that_failed_is_no_conflict_at_the_next(tmp_path, monkeypatch):
    import errno

    from kvtier.segment.lease import Lease

    with SafeDir.open(tmp_path) as directory:
        lease = Lease(directory, "a", 120.0)
        lease.beat()
        real = SafeDir.replace_file

        def full(self, name, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(SafeDir, "replace_file", full)
        with pytest.raises(OSError):
            lease.beat()
        monkeypatch.setattr(SafeDir, "replace_file", real)
        lease.beat()  # its own lease, one beat behind: no conflict
        assert read_lease(directory).beat == 2
        (tmp_path / "lease").write_bytes(LeaseInfo("a", "elsewhere", 9, 1, 1, 1).encode())
        with pytest.raises(OSError, match="elsewhere, pid 9"):
            lease.beat()
