"""A short soak in CI: mixed load, injected faults, a kill -9 restart; nothing wrong served."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.redis_server import needs_redis

ROOT = Path(__file__).resolve().parents[1]


def soak(tmp_path, minutes: float, *flags: str) -> dict:
    """Run the soak; what it wrote to its JSON, once it exited 0."""
    out = tmp_path / "soak.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--minutes",
                             str(minutes), "--dir", str(tmp_path / "cache"), "--json", str(out),
                             *flags], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_short_soak_serves_no_wrong_byte(tmp_path):
    data = soak(tmp_path, 0.25)
    counts = data["counts"]
    assert counts["wrong_bytes_served"] == 0 and counts.get("escaped_exceptions", 0) == 0
    assert counts["gets"] > 100 and counts["puts"] > 100
    assert sum(v for k, v in counts.items() if k.startswith("fault ")) >= 10
    # bytes flipped in, or cut off, the slot files the store wrote (wherever its layout puts
    # them), and faults met on reading, caught: whether a flipped byte is read again before
    # its chunk leaves is chance (a short soak once read none of 11 back); that one read is
    # caught is tests/test_disk_faults.py's
    assert counts.get("fault flip", 0) + counts.get("fault truncate", 0) >= 1
    assert counts["counted corruptions"] + counts["counted io_errors"] >= 1
    # the byte flipped at each phase's end in a chunk read back next is caught every time
    assert counts["probe flips caught"] == data["phases"] and "probe flips missed" not in counts
    assert counts["fault kill -9 of a writer"] >= 1 and data["fd_drift"] == 0
    assert counts["phases write_through"] >= 1 and counts["phases write_back"] >= 1


@needs_redis
def test_a_short_soak_of_a_fleets_tiers_serves_no_wrong_byte(tmp_path):
    """The remote tier (a redis-server of the soak's own, and a second store standing for
    another node) and a shared directory (a peer writer killed mid-phase), under faults of
    both besides the disk's."""
    data = soak(tmp_path, 0.3, "--remote", "--shared")
    counts = data["counts"]
    assert counts["wrong_bytes_served"] == 0 and counts.get("escaped_exceptions", 0) == 0
    assert counts["gets"] > 100 and counts["puts"] > 100
    assert sum(v for k, v in counts.items() if k.startswith("fault remote")) >= 5
    assert counts["fault kill -9 of a peer writer mid-phase"] >= 1
    # chunks came from the remote store and from the peer's segment, not only from disk
    assert counts["counted remote_reads"] >= 1 and counts["counted shared_reads"] >= 1
    assert data["fd_drift"] == 0
