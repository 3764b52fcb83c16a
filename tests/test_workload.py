"""The repeated-prefix serving benchmark runs end to end on a small load."""

import json
import subprocess
import sys

import pytest

from tests.helpers.vllm_engine import ROOT, have_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not have_vllm(), reason="vLLM not installed")]


def test_workload_reports_every_engine_and_kvtier_serves_more_from_cache(tmp_path):
    out = tmp_path / "workload.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "workload.py"), "--docs", "12", "--doc-tokens", "512",
         "--batch", "3", "--rounds", "2", "--max-tokens", "2", "--gpu-share", "0.3",
         "--peers", "example", "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    alone, tiered, example = data["rows"]
    assert alone["engine"] == "prefix cache only" and tiered["engine"] == "prefix cache + kvtier"
    assert example["engine"] == "prefix cache + ExampleConnector" and example["baseline"] == "alone"
    assert tiered["vs_baseline"] == pytest.approx(data["speedup"])
    assert example["cached_share"] >= alone["cached_share"]  # it hits a document + a short question
    assert len(alone["round_seconds"]) == len(tiered["round_seconds"]) == 2
    assert tiered["cached_share"] > alone["cached_share"]  # documents vLLM evicted, kvtier kept
    assert data["kvtier"]["load_chunks_host"] > 0  # the hits came from kvtier's host tier


def test_the_chat_load_carries_each_conversation_forward(tmp_path):
    out = tmp_path / "chat.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "workload.py"), "--pattern", "chat", "--docs", "6",
         "--doc-tokens", "256", "--question-tokens", "256", "--batch", "2", "--rounds", "3",
         "--max-tokens", "2", "--gpu-share", "0.3", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    alone, tiered = data["rows"]
    assert len(tiered["round_seconds"]) == 3
    assert tiered["cached_share"] >= alone["cached_share"] > 0  # the system prompt at least
    assert data["kvtier"]["stored_chunks"] > 0
