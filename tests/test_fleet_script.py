"""The fleet benchmark runs end to end on a small load: engines on one shared directory hit
documents other engines computed, private caches do not, and a commit in one engine becomes
a hit in another."""

import json
import math
import subprocess
import sys

import pytest

from tests.helpers.vllm_engine import ROOT, have_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not have_vllm(), reason="vLLM not installed")]


def test_engines_on_a_shared_directory_hit_what_the_others_computed(tmp_path):
    out = tmp_path / "fleet.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fleet.py"), "--engines", "2", "--docs", "4",
         "--doc-tokens", "512", "--batch", "2", "--rounds", "2", "--max-tokens", "2",
         "--probes", "2", "--share-refresh", "200ms", "--settle", "1.5", "--dir", str(tmp_path),
         "--json", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [rows[arm]["engines"] for arm in ("shared", "private", "one")] == [2, 2, 1]
    assert rows["shared"]["cached_share"] == pytest.approx(rows["one"]["cached_share"], abs=0.05)
    assert rows["shared"]["cached_share"] > rows["private"]["cached_share"]
    assert all(c.get("load_chunks_shared", 0) > 0 for c in rows["shared"]["kvtier"].values())
    assert not any(c.get("load_chunks_shared", 0) for c in rows["private"]["kvtier"].values())
    delays = data["commit_to_hit_s"]
    assert len(delays) == 2 and all(math.isfinite(d) and d < 30 for d in delays)
    assert not list(tmp_path.glob("kvtier-fleet-*"))  # its scratch directory is gone
