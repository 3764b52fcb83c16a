"""Two processes storing and loading overlapping prefixes at once (on one directory, each in
its own segment), then two more that restart on what they left: no wrong byte, no exception,
descriptors and memory stable."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECONDS = 6


def run_two(first: Path, second: Path, out: Path) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.mixed_load", str(path), str(SECONDS),
                               str(seed), str(out / f"p{seed}.json")], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for seed, path in enumerate([first, second])]
    for proc in procs:
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output[-3000:]
    return [json.loads((out / f"p{seed}.json").read_text()) for seed in range(2)]


def check_clean(result: dict, others: int = 0) -> None:
    """No wrong byte, no exception; descriptors stable, but for the files of ``others``
    writers on the same directory, which a store opens when it first reads them (their
    log, and here their one slot file)."""
    counts = result["counts"]
    assert counts["wrong_bytes_served"] == 0 and counts.get("escaped_exceptions", 0) == 0, counts
    assert counts["puts"] > 20 and counts["gets"] > 20 and counts["hit_tokens"] > 0
    assert 0 <= result["end"]["fds"] - result["warm"]["fds"] <= 2 * others, result
    assert result["end"]["rss_mib"] - result["warm"]["rss_mib"] < 48, result


def said(result: dict) -> None:
    """Print what a process's store logged and its flush said (shown, whole, when the test
    fails: an assertion's message is cut short)."""
    print(f"flush: {result['flush']}", *result["warnings"], sep="\n")


@pytest.mark.parametrize("sharing", ["one directory", "a directory each"])
def test_two_processes_then_a_restart(tmp_path, sharing):
    first = tmp_path / "cache"
    second = first if sharing == "one directory" else tmp_path / "cache2"
    for path in {first, second}:
        path.mkdir(mode=0o700)
    others = 1 if first == second else 0
    results = run_two(first, second, tmp_path)
    for result in results:
        check_clean(result, others)
    # on one directory each process writes its own segment (a writer id of its own)
    for result in results:
        said(result)
        assert not result["paths_down"], f"a path went down: {result['paths_down']}"
        assert result["disk_writes"] > 0, f"no disk write; flush: {result['flush']}"

    again = run_two(first, second, tmp_path)  # restart on what the first two left
    for result in again:
        check_clean(result, others)
        said(result)
        assert not result["paths_down"], f"a path went down: {result['paths_down']}"
        assert result["recovered"] > 0 and result["disk_reads"] > 0
