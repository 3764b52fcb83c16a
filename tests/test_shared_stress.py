"""Three processes of three threads each share one directory, every thread putting and getting
overlapping prefixes of one family, while each writer's few slots are overwritten all the
time; one writer is killed with kill -9 and restarted under its instance_id, then another.
Every byte any thread is served is checked: none is wrong. Every process (the restarted ones
too, which take their own seat and segment back) hits, reads other writers' chunks, and
exits cleanly."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.shared_stress import WRITERS

ROOT = Path(__file__).resolve().parents[1]
PHASE = 3.0  # seconds between kills, and at least after the last restart
START_TIMEOUT = 60.0
MIN_GETS = 50  # every process's gets before the stop (a loaded machine may need over PHASE)


def launch(tmp_path: Path, name: str, seed: int) -> subprocess.Popen:
    """A worker for ``name``; its output goes to ``NAME-SEED.log``."""
    with (tmp_path / f"{name}-{seed}.log").open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.shared_stress", str(tmp_path / "cache"), name,
             str(seed), str(tmp_path / "stop"), str(tmp_path / f"{name}.json")],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)


def wait_ready(proc: subprocess.Popen, log: Path) -> None:
    """Until the worker has opened its store (bounded)."""
    deadline = time.monotonic() + START_TIMEOUT
    while "ready" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


def wait_gets(procs: dict, logs: dict) -> None:
    """Until every worker's printed counts show MIN_GETS gets (bounded)."""
    deadline = time.monotonic() + START_TIMEOUT
    for name, proc in procs.items():
        while last_counts(logs[name]).get("gets", 0) < MIN_GETS:
            assert proc.poll() is None and time.monotonic() < deadline, logs[name].read_text()[-3000:]
            time.sleep(0.1)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def last_counts(log: Path) -> dict:
    """The counts a worker printed last (on a whole line: it may be writing the next)."""
    whole = log.read_text().split("\n")[:-1]
    lines = [line for line in whole if line.startswith("counts ")]
    return json.loads(lines[-1].removeprefix("counts ")) if lines else {}


def test_many_threaded_writers_killed_and_restarted_never_serve_a_wrong_byte(tmp_path):
    (tmp_path / "cache").mkdir(mode=0o700)
    names = [f"s{i}" for i in range(WRITERS)]
    procs = {name: launch(tmp_path, name, seed) for seed, name in enumerate(names)}
    logs = {name: tmp_path / f"{name}-{seed}.log" for seed, name in enumerate(names)}
    killed, began = [], time.monotonic()
    try:
        for name in names:
            wait_ready(procs[name], logs[name])
        timeline = [f"ready {time.monotonic() - began:.1f}s"]
        for seed, victim in enumerate(names[1:], start=len(names)):
            time.sleep(PHASE)
            kill(procs[victim])
            killed.append(logs[victim])
            procs[victim] = launch(tmp_path, victim, seed)  # the same instance_id
            logs[victim] = tmp_path / f"{victim}-{seed}.log"
            wait_ready(procs[victim], logs[victim])
            timeline.append(f"{victim} back {time.monotonic() - began:.1f}s")
        time.sleep(PHASE)
        wait_gets(procs, logs)
        (tmp_path / "stop").touch()
        for name, proc in procs.items():
            proc.wait(timeout=90)
            assert proc.returncode == 0, logs[name].read_text()[-3000:]
        print(*timeline, f"all exited {time.monotonic() - began:.1f}s")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                kill(proc)
    for log in [*killed, *logs.values()]:
        assert "WRONG" not in log.read_text(), log.read_text()[-3000:]
    for log in killed:  # it was checking bytes when it was killed
        counts = last_counts(log)
        print(log.name, counts)
        assert counts.get("gets", 0) > 0 and counts["wrong_bytes"] == 0, counts
    results = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in names}
    print(json.dumps(results))
    for result in results.values():
        counts = result["counts"]
        assert not result["errors"] and result["closed"] and not result["hung_threads"], result
        assert counts["wrong_bytes"] == 0 and counts["bad_lengths"] == 0, result
        assert counts["gets"] >= MIN_GETS and counts["hits"] > 0 and counts["puts"] > 0, result
        assert result["shared_reads"] > 0 and result["paths_down"] == {}, result
        assert result["shared_writers"] == WRITERS - 1, result
    for victim in names[1:]:  # restarted: its own seat and segment, with its chunks
        assert results[victim]["recovered_chunks"] > 0, results[victim]
