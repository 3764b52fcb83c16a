"""The halt of sampled checks (``verify_halt_after``): past the limit an engine writes the
namespace's halt file and serves no hit; an engine that starts, or one running beside it,
finds the file and halts too; removing it (``kvtier verify --repair``, ``kvtier clear``) ends
every halt that came from it. Only a regular file of this user counts: a symlink or a FIFO
under its name is ignored (no one else can stop an engine's hits, nothing blocks), and a
halt whose file could not be written lasts until the engine restarts."""

import json
import os
from collections import Counter

from kvtier.connector.scheduler.verify_halt import VerifyHalt
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
