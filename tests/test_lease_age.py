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


class ClientClockBeats:
    """A live writer elsewhere on a filesystem whose clients set file times by their own
    clocks, this one 15 minutes behind: it rewrites its lease every 50 ms (a new file, its
    time set, renamed over the lease), each time dated 15 minutes ago."""

    def __init__(self, segment):
        import threading

        self.segment, self.stop = segment, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        beat = 1
        while not self.stop.wait(0.05):
            self.beat(beat := beat + 1)

    def beat(self, beat):
        now = time.time_ns() - 15 * MINUTE
        lease = LeaseInfo(self.segment.name, "nodeB", 4242, beat, now - (beat - 1) * 10**8,
                          now, 1, 600, 0, 1, OTHER_BOOT)
        temp = self.segment / f".lease.tmp-4242-{beat:08x}"
        temp.write_bytes(lease.encode())
        os.utime(temp, ns=(now, now))
        temp.rename(self.segment / "lease")

    def __enter__(self):
        self.beat(1)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def test_a_live_writer_whose_file_times_look_old_is_kept_by_the_watch_before_a_change(tmp_path):
    root = tmp_path / "cache"
    segment = make_cache(root, instance_id="nodeB-0")
    with ClientClockBeats(segment):
        code, gone = report("gc", root, "--gone", "10m")
        assert code == 1 and gone["skipped_in_use"] == [label(segment)] and segment.exists()
        code, freed = report("gc", root, "--older-than", "0s")
        assert code == 1 and freed["skipped_in_use"] == [label(segment)] and freed["chunks_freed"] == 0
        code, repaired = report("verify", root, "--repair")
        assert code == 1 and "changed while watched" in repaired["namespaces"][0]["writers"][0]["problem"]
        code, cleared = report("clear", root, "--yes")
        assert code == 1 and cleared["in_use"] == [label(segment)] and segment.exists()
    code, gone = report("gc", root, "--gone", "10m")  # it stopped: its lease stands still
    assert code == 0 and gone["segments_removed"] == [label(segment)] and not segment.exists()


def test_a_command_waits_once_for_all_the_leases_it_watches():
    from kvtier.ops.liveness import LeaseLooks, watch_span

    now, slept = [100.0], []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    looks = LeaseLooks(clock=lambda: now[0], sleep=sleep)
    looks.note(("a", 1, 1), b"1")
    looks.note(("b", 1, 2), b"1")
    now[0] += 0.5
    assert not looks.changed(("a", 1, 1), lambda: b"1", 2.0) and slept == [1.5]  # the rest of 2 s
    assert not looks.changed(("b", 1, 2), lambda: b"1", 2.0) and slept == [1.5]  # none left
    beats = iter([b"2", b"3"])
    assert looks.changed(("c", 1, 3), lambda: next(beats), 2.0) and slept == [1.5, 2.0]
    looks.forget()  # a new command: what this process saw before counts no more
    assert not looks.changed(("a", 1, 1), lambda: b"1", 2.0) and slept == [1.5, 2.0, 2.0]
    lease = LeaseInfo("w", "h", 1, 7, 0, 6 * 10**9, 0, 0)
    assert watch_span(lease) == 2.0  # two beats of 1 s, by its own clock
    assert watch_span(LeaseInfo("w", "h", 1, 7, 0, 6 * 10**9, 0, 120_000)) == 40.0
    assert watch_span(LeaseInfo("w", "h", 1, 1, 0, 0, 0, 86_400_000)) == 60.0  # at most
