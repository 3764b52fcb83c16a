"""Readers in other processes hammer a writer's segment while it overwrites its slots and
is killed with kill -9, twice, and restarted on its segment: no reader is ever served a
wrong byte, and they keep getting hits."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECONDS = 6.0


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.shared_hammer", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start_writer(directory: Path, seed: int) -> subprocess.Popen:
    writer = start("writer", str(directory), "w", str(seed))
    assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
    return writer


def test_readers_never_get_a_wrong_byte_from_a_writer_killed_mid_write(tmp_path):
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    writer = start_writer(directory, 0)
    readers = [start("reader", str(directory), f"r{i}", str(i), str(SECONDS),
                     str(tmp_path / f"r{i}.json")) for i in range(2)]
    for seed in (1, 2):
        time.sleep(SECONDS / 3)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
        writer = start_writer(directory, seed)  # the same instance_id: its segment again
    for reader in readers:
        output, _ = reader.communicate(timeout=120)
        assert reader.returncode == 0, output[-3000:]
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    for i in range(2):
        result = json.loads((tmp_path / f"r{i}.json").read_text())
        counts = result["counts"]
        assert counts.get("wrong_bytes_served", 0) == 0, result
        assert counts["gets"] > 50 and counts["hit_tokens"] > 0 and result["shared_reads"] > 0, result
