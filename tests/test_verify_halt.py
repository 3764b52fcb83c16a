"""The halt of sampled checks (``verify_halt_after``): past the limit an engine writes the
namespace's halt file and serves no hit; an engine that starts, or one running beside it,
finds the file and halts too; removing it (``kvtier verify --repair``, ``kvtier clear``) ends
every halt that came from it. Only a regular file of this user counts: a symlink or a FIFO
under its name is ignored (no one else can stop an engine's hits, nothing blocks), and a
halt whose file could not be written lasts until the engine restarts."""

import errno
import json
import os
import threading
from collections import Counter

from kvtier.connector.scheduler.verify_halt import VerifyHalt
from kvtier.io.safefs import SafeDir
from kvtier.segment.halt_file import HaltFile
from tests.helpers.hostile import cli, make_cache, namespace_of
from tests.helpers.shared import wait_for


def namespace(tmp_path) -> tuple[HaltFile, os.PathLike]:
    ns = namespace_of(make_cache(tmp_path / "cache"))
    return HaltFile(ns.parent, ns.name), ns


def test_past_the_limit_the_file_is_written_and_a_restart_finds_it(tmp_path):
    marker, ns = namespace(tmp_path)
    counters = Counter()
    halt = VerifyHalt(2, counters, marker)
    halt.mismatch()
    assert not halt.halted and marker.read() is None
    halt.mismatch()
    assert halt.halted and counters["verify_halted"] == 1
    wait_for(lambda: (ns / "halt.json").exists())  # written off the scheduler's thread
    wait_for(lambda: not any(t.name == "kvtier-halt-write" for t in threading.enumerate()))
    assert json.loads((ns / "halt.json").read_text())["mismatches"] == 2
    restarted = VerifyHalt(2, Counter(), marker)
    assert restarted.halted
    assert marker.remove()
    for engine in (halt, restarted):
        engine.look()
        assert not engine.halted
    assert counters["verify_halted"] == 0
    halt.close()
    restarted.close()


def test_a_running_engine_halts_when_another_writes_the_file(tmp_path):
    marker, _ = namespace(tmp_path)
    beside = VerifyHalt(3, Counter(), marker)
    assert not beside.halted
    marker.write({"mismatches": 3})
    beside.look()
    assert beside.halted
    beside.close()


def test_a_symlink_or_a_fifo_under_its_name_halts_nothing(tmp_path):
    marker, ns = namespace(tmp_path)
    (tmp_path / "elsewhere.json").write_text("{}")
    os.symlink(tmp_path / "elsewhere.json", ns / "halt.json")
    assert marker.read() is None and not VerifyHalt(1, Counter(), marker).halted
    assert not marker.remove() and (ns / "halt.json").is_symlink()
    os.unlink(ns / "halt.json")
    os.mkfifo(ns / "halt.json")  # read() must not block on it
    assert marker.read() is None and not VerifyHalt(1, Counter(), marker).halted


def test_a_halt_whose_file_cannot_be_written_lasts(tmp_path):
    marker = HaltFile(tmp_path, "0" * 32)  # no such namespace directory
    halt = VerifyHalt(1, Counter(), marker)
    halt.mismatch()
    assert halt.halted
    halt.look()
    assert halt.halted
    halt.close()


def test_without_a_limit_nothing_halts():
    halt = VerifyHalt(0, Counter())
    for _ in range(10):
        halt.mismatch()
    assert not halt.halted


def test_verify_reports_a_halt_and_repair_ends_it(tmp_path):
    marker, ns = namespace(tmp_path)
    marker.write({"mismatches": 3})
    code, out = cli("verify", ns.parent, "--json")
    (report,) = json.loads(out)["namespaces"]
    assert code == 1 and report["halted"] and not report["halt_removed"]
    code, out = cli("verify", ns.parent)
    assert "serve no hits (halt.json)" in " ".join(out.split()) and "--repair ends it" in out
    code, out = cli("verify", ns.parent, "--repair", "--json")
    (report,) = json.loads(out)["namespaces"]
    assert code == 0 and report["halt_removed"] and marker.read() is None


def test_a_halt_file_nested_past_the_parsers_depth_reads_as_a_halt_and_stops_nothing(tmp_path):
    """4,000 ``[`` (within the file's bound) make the JSON parser raise ``RecursionError``:
    read as a halt of no detail, never an engine that cannot start or a CLI traceback."""
    marker, ns = namespace(tmp_path)
    (ns / "halt.json").write_text("[" * 4000)
    assert marker.read() == {}
    halt = VerifyHalt(3, Counter(), marker)
    assert halt.halted
    halt.close()
    for command in ("inspect", "verify"):
        code, out = cli(command, ns.parent, "--json")
        assert code in (0, 1) and "Traceback" not in out, (command, out)


def test_inspect_says_a_namespace_is_halted(tmp_path):
    marker, ns = namespace(tmp_path)
    code, out = cli("inspect", ns.parent, "--json")
    assert code == 0 and json.loads(out)["namespaces"][0]["halted"] is False
    marker.write({"mismatches": 3})
    code, out = cli("inspect", ns.parent, "--json")
    assert json.loads(out)["namespaces"][0]["halted"] is True
    code, out = cli("inspect", ns.parent)
    assert "serve no hits" in " ".join(out.split())


def test_clear_removes_a_halted_namespace_whole(tmp_path):
    marker, ns = namespace(tmp_path)
    marker.write({"mismatches": 3})
    code, _ = cli("clear", ns.parent, "--yes")
    assert code == 0 and not ns.exists()


def test_a_halt_file_that_cannot_be_read_for_a_moment_keeps_the_halt(tmp_path, monkeypatch):
    """EIO or ESTALE on a network filesystem is not the file's removal: the halt goes on,
    and the state is kept until a read tells; only ENOENT ends it."""
    marker, ns = namespace(tmp_path)
    halt = VerifyHalt(1, Counter(), marker)
    halt.mismatch()
    wait_for(lambda: (ns / "halt.json").exists())
    halt.look()
    real = SafeDir.open

    def unreadable(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(SafeDir, "open", unreadable)
    for _ in range(2):
        halt.look()
        assert halt.halted and marker.read() is None  # offline commands: no halt counted
    monkeypatch.setattr(SafeDir, "open", real)
    halt.look()
    assert halt.halted
    assert marker.remove()
    halt.look()
    assert not halt.halted
    halt.close()


def test_a_look_that_read_before_the_engines_own_halt_file_was_written_ends_nothing(tmp_path):
    """The watching thread reads no file, then this engine's halt file is written (its
    own halt), then the watcher takes the lock: its read is older than the file, and must
    not end the halt the file now holds."""
    _, ns = namespace(tmp_path)
    release, written = threading.Event(), threading.Event()

    class Racing(HaltFile):
        def write(self, record):
            release.wait(10)
            super().write(record)

        def look(self):
            return self._raced(super().look())

        def read(self):  # what an engine followed the file with before ``look``
            return self._raced(super().read())

        def _raced(self, there):
            release.set()  # the write lands after this read ...
            written.wait(10)  # ... and is recorded before the look takes the lock
            return there

    marker = Racing(ns.parent, ns.name)
    halt = VerifyHalt(1, Counter(), None)
    halt.mismatch()  # halted (its file is written below, as the engine's thread would)
    halt.marker = marker
    original = halt._write

    def write(mismatches):
        original(mismatches)
        written.set()

    halt._write = write
    threading.Thread(target=halt._write, args=(1,), daemon=True).start()
    halt.look()
    assert (ns / "halt.json").exists()
    assert halt.halted, "a look older than the halt file ended the halt"
    halt.close()


def test_the_watcher_looks_only_at_a_path_that_answers(tmp_path, monkeypatch):
    """The halt file's path on a hung mount: the watcher's looks wait for it to answer
    (each asked, bounded), rather than block its thread for ever in a look."""
    import kvtier.connector.scheduler.verify_halt as verify_halt

    marker, _ = namespace(tmp_path)
    answering, looked = threading.Event(), []
    monkeypatch.setattr(verify_halt, "LOOK_EVERY_S", 0.01)
    monkeypatch.setattr(verify_halt, "answers", lambda root, timeout: answering.is_set())
    monkeypatch.setattr(VerifyHalt, "look", lambda self: looked.append(True))
    halt = VerifyHalt(3, Counter(), marker)
    try:
        threading.Event().wait(0.2)
        assert looked == []  # not even the first look, before any step
        answering.set()
        wait_for(lambda: looked)
    finally:
        halt.close()


def test_a_halt_ends_only_when_its_file_is_gone_from_the_disk_path(tmp_path):
    """(not when the disk path is unmounted or replaced, its directories stop being safe,
    or a backup hard-links the file: each cannot tell whether the halt still holds)"""
    marker, ns = namespace(tmp_path)
    marker.write({"mismatches": 3})
    halt = VerifyHalt(3, Counter(), marker)
    assert halt.halted
    root = ns.parent
    root.rename(tmp_path / "unmounted")  # the disk path gone
    halt.look()
    assert halt.halted
    (tmp_path / "unmounted").rename(root)
    os.chmod(ns, 0o777)  # its namespace's directory writable by anyone: not kvtier's
    halt.look()
    assert halt.halted
    os.chmod(ns, 0o700)
    os.link(ns / "halt.json", tmp_path / "backup.json")  # a second hard link
    halt.look()
    assert halt.halted
    os.unlink(tmp_path / "backup.json")
    halt.look()
    assert halt.halted
    os.unlink(ns / "halt.json")
    halt.look()
    assert not halt.halted
    halt.close()


def test_the_halt_file_is_synced_and_its_name_too(tmp_path, monkeypatch):
    """(a restart after a power loss still finds the halt; a filesystem that syncs nothing
    halts all the same: ``sync_if_able``)"""
    from kvtier.segment import halt_file, slot_files

    marker, _ = namespace(tmp_path)
    synced = []

    def sync_if_able(fd):
        synced.append(os.path.isdir(f"/proc/self/fd/{fd}"))
        slot_files.sync_if_able(fd)

    monkeypatch.setattr(halt_file, "sync_if_able", sync_if_able)
    marker.write({"mismatches": 3})
    assert synced == [False, True]  # the file, then its directory
    assert marker.read()["mismatches"] == 3
