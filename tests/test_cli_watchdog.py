"""Every offline command over a cache root has one deadline (--timeout): a filesystem that
stops answering (a hung network filesystem, stood in for by a step that never returns) ends
the command on time, with one line saying so, exit 1."""

import subprocess
import sys
import time

import pytest

from tests.helpers.cli import two_writers

HANG = """
import sys, time
import kvtier.ops.{module} as ops
ops.{name} = lambda *args, **kwargs: time.sleep(60)
from kvtier.cli.main import main
sys.argv = ["kvtier", *sys.argv[1:]]
main()
"""
CASES = {  # command: (its arguments past PATH, the step made to hang)
    "inspect": ([], ("inspect", "inspect_namespace")),
    "verify": ([], ("verify", "verify_namespace")),
    "gc": (["--older-than", "1d"], ("reclaim", "gc")),
    "clear": (["--yes"], ("removal", "clear")),
}


def run_hung(command: str, root, *more: str) -> tuple[subprocess.CompletedProcess, float]:
    args, (module, name) = CASES[command]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", HANG.format(module=module, name=name), command,
                           str(root), *args, *more], capture_output=True, text=True, timeout=50)
    return done, time.monotonic() - started


@pytest.mark.parametrize("command", sorted(CASES))
def test_a_command_that_never_ends_stops_at_its_timeout(command, tmp_path):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    two_writers(root)  # a namespace to work on
    done, took = run_hung(command, root, "--timeout", "1")
    assert done.returncode == 1, done.stderr
    assert f"kvtier: {command}: --timeout 1 s ran out" in done.stderr
    assert took < 40  # the hung step sleeps 60 s


@pytest.mark.parametrize("value", ["0", "-3", "nan"])
def test_a_timeout_that_is_no_duration_is_refused(value, tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "verify", str(tmp_path),
                           "--timeout", value], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--timeout must be a positive number" in done.stderr
