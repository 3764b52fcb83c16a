"""A short soak in CI: mixed load, injected faults, a kill -9 restart; nothing wrong served."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_short_soak_serves_no_wrong_byte(tmp_path):
    out = tmp_path / "soak.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--minutes", "0.25",
                             "--dir", str(tmp_path / "cache"), "--json", str(out)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    counts = data["counts"]
    assert counts["wrong_bytes_served"] == 0 and counts.get("escaped_exceptions", 0) == 0
    assert counts["gets"] > 100 and counts["puts"] > 100
    assert sum(v for k, v in counts.items() if k.startswith("fault ")) >= 10
    # bytes flipped in, or cut off, the slot files the store wrote (wherever its layout puts
    # them), and the store caught some of them on reading
    assert counts.get("fault flip", 0) + counts.get("fault truncate", 0) >= 1
    assert counts["counted corruptions"] >= 1
    assert counts["fault kill -9 of a writer"] >= 1 and data["fd_drift"] == 0
    assert counts["phases write_through"] >= 1 and counts["phases write_back"] >= 1
