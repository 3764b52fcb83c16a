"""``kvtier inspect | verify | gc | clear | gpu`` on caches written by the store."""

import json
import os
import time
from types import SimpleNamespace

import pytest

from kvtier import KVStore
from kvtier.disk import stamps
from kvtier.ops.victims import WINDOW_S
from tests.helpers.cli import as_json, kvtier, logged_slots, old_layout_namespace, two_writers
from tests.helpers.hostile import label, namespace_of, segment_dir
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.store import STRIDE, config, seq


@pytest.fixture
def cache(tmp_path):
    """A cache root holding 6 chunks of one namespace, written by a KVStore and closed."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    with KVStore(SMALL, config(root)) as store:
        store.put(seq(0, 6), make_kv(seq(0, 6)))
        store.flush()
    return root


def slot_file(root):
    return segment_dir(root) / "slots-0000.kvt"


def only_writer(data):
    """The report of the one writer of the one namespace in ``kvtier verify --json`` output."""
    (ns,) = data["namespaces"]
    (writer,) = ns["writers"]
    return writer


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x55
    path.write_bytes(bytes(data))


def recovered(root):
    with KVStore(SMALL, config(root)) as store:
        return store.stats().recovered_chunks


def test_inspect_shows_the_namespace(cache):
    code, data = as_json("inspect", cache)
    assert code == 0
    (ns,) = data["namespaces"]
    assert ns["status"] == "ok" and not ns["in_use"]
    assert ns["chunks"] == 6 and ns["kv_dtype"] == "bfloat16" and ns["chunk_tokens"] == 16
    assert ns["tp"] == "0/1" and ns["compression_ratio"] == pytest.approx(1.0)
    assert 0 <= ns["age_seconds"]["min"] <= ns["age_seconds"]["max"] < 600
    (writer,) = ns["writers"]
    assert writer["writer"] == segment_dir(cache).name and writer["status"] == "ok"
    assert writer["chunks"] == 6 and writer["stored_bytes"] == ns["stored_bytes"]
    assert writer["pid"] == os.getpid() and writer["beat"] >= 1 and writer["host"]
    assert 0 <= writer["lease_age_seconds"] < 600 and not writer["in_use"]
    table = kvtier("inspect", cache)
    assert table.returncode == 0 and ns["id"][:12] in table.stdout
    assert writer["writer"] in table.stdout


def test_inspect_sees_a_namespace_in_use(cache):
    with KVStore(SMALL, config(cache)):
        _, data = as_json("inspect", cache)
    (ns,) = data["namespaces"]
    assert ns["in_use"] is True and ns["writers"][0]["in_use"] is True


def test_verify_passes_a_good_cache(cache):
    code, data = as_json("verify", cache)
    assert code == 0 and data["problems"] == 0
    assert data["namespaces"][0]["ok"] == 6 and data["namespaces"][0]["slots"] == 64
    found = only_writer(data)
    assert found["ok"] == 6 and found["writer"] == segment_dir(cache).name


def test_verify_finds_and_repairs_a_corrupt_payload(cache):
    flip(slot_file(cache), 2 * STRIDE + 4096 + 100)
    code, data = as_json("verify", cache)
    assert code == 1 and only_writer(data)["corrupt"] == [2]
    code, data = as_json("verify", cache, "--repair")
    assert code == 0 and only_writer(data)["repaired"] >= 1
    assert logged_slots(segment_dir(cache)) == {0, 1, 3, 4, 5}
    code, data = as_json("verify", cache)
    assert code == 0 and only_writer(data)["ok"] == 5
    assert recovered(cache) == 5


def test_verify_finds_a_torn_header(cache):
    flip(slot_file(cache), 4 * STRIDE + 30)
    code, data = as_json("verify", cache)
    assert code == 1 and only_writer(data)["torn"] == [4]


def test_verify_calls_a_header_with_a_generation_no_engine_accepts_torn_and_repairs_it(cache):
    """A checked header whose generation is past ``MAX_GENERATION``: the engines' reader
    rejects it, and verify called it ok (and --repair re-indexed it at every run: a review)."""
    import dataclasses

    from kvtier.io.format import HEADER_BYTES, decode_header

    with open(slot_file(cache), "r+b") as slots:
        header = decode_header(slots.read(HEADER_BYTES))
        slots.seek(0)
        slots.write(dataclasses.replace(header, generation=(1 << 63) + 5).encode()[:HEADER_BYTES])
    code, data = as_json("verify", cache)
    assert code == 1 and only_writer(data)["torn"] == [0]
    assert as_json("verify", cache, "--repair")[0] == 0
    code, data = as_json("verify", cache)
    assert code == 0 and only_writer(data)["ok"] == 5 and recovered(cache) == 5


def test_verify_finds_an_index_naming_chunks_of_a_slot_file_gone(cache):
    """The slot file removed: the index was not read at all (no slot file to bound it), and
    verify said all was well (a review)."""
    slot_file(cache).unlink()
    code, data = as_json("verify", cache)
    assert code == 1 and only_writer(data)["stale_index"] == list(range(6))
    assert as_json("verify", cache, "--repair")[0] == 0
    assert as_json("verify", cache)[0] == 0


def test_verify_reindexes_slots_the_index_lost(cache):
    index = segment_dir(cache) / "index.kvt"
    index.write_bytes(bytes(index.stat().st_size))
    code, data = as_json("verify", cache)
    assert code == 1 and len(only_writer(data)["unindexed"]) == 6
    assert as_json("verify", cache, "--repair")[0] == 0
    assert as_json("verify", cache)[0] == 0


def test_verify_checks_but_never_repairs_a_segment_in_use(cache):
    flip(slot_file(cache), 4096 + 5)
    before = slot_file(cache).read_bytes()
    with KVStore(SMALL, config(cache)):
        code, data = as_json("verify", cache, "--repair")
        text = kvtier("verify", cache, "--repair")
    found = only_writer(data)
    assert code == 1 and found["in_use"] and "in use" in found["problem"]
    assert found["corrupt"] == [0] and found["repaired"] == 0
    assert text.returncode == 1 and "in use" in " ".join(text.stdout.split())  # wrapped to fit
    assert slot_file(cache).read_bytes() == before


def test_gc_by_age_dry_run_then_for_real(cache):
    code, data = as_json("gc", cache, "--older-than", "0s", "--dry-run")
    assert code == 0 and data["chunks_freed"] == 6 and data["dry_run"]
    assert recovered(cache) == 6
    blocks_before = slot_file(cache).stat().st_blocks
    assert logged_slots(segment_dir(cache)) == set(range(6))
    code, data = as_json("gc", cache, "--older-than", "0s")
    assert data["chunks_freed"] == 6
    assert logged_slots(segment_dir(cache)) == set()  # readers following the log forget them
    assert recovered(cache) == 0
    assert slot_file(cache).stat().st_blocks < blocks_before  # space really given back
    assert as_json("verify", cache)[0] == 0


def test_gc_to_a_size_target_keeps_the_newest(cache, monkeypatch):
    later = time.time_ns() + int(2 * WINDOW_S * 1e9)  # a write window after the cache's chunks
    monkeypatch.setattr(stamps, "time", SimpleNamespace(time_ns=lambda: later))
    with KVStore(SMALL, config(cache)) as store:
        store.put(seq(5000, 2), make_kv(seq(5000, 2)))
        store.flush()
    monkeypatch.undo()
    code, data = as_json("gc", cache, "--target", str(2 * SMALL.token_bytes * 16))
    assert code == 0 and data["chunks_freed"] == 6
    with KVStore(SMALL, config(cache)) as store:
        assert store.lookup(seq(5000, 2)).tokens == 32 and store.lookup(seq(0, 6)).tokens == 0


def test_gc_never_touches_a_namespace_in_use(cache):  # finding 15: exit 1 as documented
    with KVStore(SMALL, config(cache)):
        code, data = as_json("gc", cache, "--older-than", "0s")
    assert code == 1 and data["chunks_freed"] == 0
    assert data["skipped_in_use"] == [label(segment_dir(cache))]
    assert recovered(cache) == 6


@pytest.mark.parametrize("version", [1, 2])
def test_gc_removes_stale_namespaces(cache, version):
    stale = old_layout_namespace(cache, version)
    code, data = as_json("inspect", cache)
    assert {ns["id"]: ns["status"] for ns in data["namespaces"]}[stale.name] == "stale"
    code, data = as_json("gc", cache, "--stale", "--dry-run")
    assert code == 0 and data["namespaces_removed"] == [stale.name] and stale.exists()
    code, data = as_json("gc", cache, "--stale")
    assert code == 0 and data["namespaces_removed"] == [stale.name] and not stale.exists()
    assert recovered(cache) == 6


def test_gc_never_removes_a_namespace_of_a_newer_format(cache):
    """A fleet in the middle of an upgrade writes a later format: an old node's gc --stale
    removed it (a review)."""
    newer = old_layout_namespace(cache, 99)
    code, data = as_json("inspect", cache)
    assert {ns["id"]: ns["status"] for ns in data["namespaces"]}[newer.name] == "newer"
    for dry_run in (("--dry-run",), ()):
        code, data = as_json("gc", cache, "--stale", *dry_run)
        assert code == 0 and data["namespaces_removed"] == [] and data["unreadable"] == [newer.name]
        assert "newer kvtier" in data["reasons"][newer.name]
    assert (newer / "slots-0000.kvt").exists() and recovered(cache) == 6


def test_gc_leaves_a_stale_namespace_in_use(cache):
    import fcntl

    stale = old_layout_namespace(cache)
    with open(stale / "lock", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        code, data = as_json("gc", cache, "--stale")
        _, seen = as_json("inspect", cache)
    assert code == 1 and data["skipped_in_use"] == [stale.name] and not data["namespaces_removed"]
    assert {ns["id"]: ns["in_use"] for ns in seen["namespaces"]}[stale.name] is True
    assert (stale / "slots-0000.kvt").exists()


def test_gc_needs_something_to_do(cache):
    result = kvtier("gc", cache)
    assert result.returncode == 2 and "--older-than" in result.stderr


def test_clear_asks_then_removes(cache):
    assert kvtier("clear", cache, stdin="n\n").returncode == 1
    assert recovered(cache) == 6
    segment = segment_dir(cache)
    code, data = as_json("clear", cache, "--yes")
    assert code == 0 and data["removed"] == [namespace_of(segment).name]
    assert data["segments_removed"] == [label(segment)]
    assert list(cache.iterdir()) == []


def test_clear_leaves_a_namespace_in_use(cache):
    segment = segment_dir(cache)
    with KVStore(SMALL, config(cache)):
        code, data = as_json("clear", cache, "--yes")
    assert code == 1 and data["in_use"] == [label(segment)] and not data["removed"]
    assert (segment / "slots-0000.kvt").exists()
    assert (namespace_of(segment) / "namespace.json").exists()


def test_inspect_lists_every_writer_of_a_namespace(tmp_path):
    two_writers(tmp_path)
    with KVStore(SMALL, config(tmp_path, instance_id="w-a", share_writers=4)):
        code, data = as_json("inspect", tmp_path)
        table = kvtier("inspect", tmp_path)
    (ns,) = data["namespaces"]
    writers = {w["writer"]: w for w in ns["writers"]}
    assert code == 0 and sorted(writers) == ["w-a", "w-b"]
    assert writers["w-a"]["chunks"] == 3 and writers["w-b"]["chunks"] == 2 and ns["chunks"] == 5
    assert writers["w-a"]["in_use"] and not writers["w-b"]["in_use"] and ns["in_use"]
    assert writers["w-a"]["beat"] >= 1 and writers["w-a"]["pid"] == os.getpid()
    assert ns["stored_bytes"] == writers["w-a"]["stored_bytes"] + writers["w-b"]["stored_bytes"]
    assert "w-a" in table.stdout and "w-b" in table.stdout and "(in use)" in table.stdout


def test_gc_and_clear_skip_a_writer_in_use_and_handle_the_other(tmp_path):
    a, b = two_writers(tmp_path)
    with KVStore(SMALL, config(tmp_path, instance_id="w-a", share_writers=4)):
        code, data = as_json("gc", tmp_path, "--older-than", "0s")
        assert code == 1 and data["chunks_freed"] == 2 and data["skipped_in_use"] == [label(a)]
        code, data = as_json("clear", tmp_path, "--yes")
        assert code == 1 and data["in_use"] == [label(a)] and not data["removed"]
        assert data["segments_removed"] == [label(b)] and not b.exists()
        assert (a / "slots-0000.kvt").exists() and (a.parent.parent / "namespace.json").exists()
    with KVStore(SMALL, config(tmp_path, instance_id="w-a", share_writers=4)) as store:
        assert store.stats().recovered_chunks == 3
    code, data = as_json("clear", tmp_path, "--yes")
    assert code == 0 and data["segments_removed"] == [label(a)] and list(tmp_path.iterdir()) == []


def test_symlinks_are_never_followed_out_of_the_root(cache, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "namespace.json").write_text("{}")
    (outside / "slots-0000.kvt").write_bytes(b"precious")
    (cache / ("cd" * 16)).symlink_to(outside)
    code, data = as_json("inspect", cache)
    statuses = {ns["id"]: ns["status"] for ns in data["namespaces"]}
    assert code == 1 and statuses["cd" * 16] == "unsafe"  # named like one: never followed
    code, data = as_json("clear", cache, "--yes")
    assert code == 1, data  # the link left alone, said
    assert (outside / "slots-0000.kvt").read_bytes() == b"precious"
    assert (cache / ("cd" * 16)).is_symlink()
    link_root = tmp_path / "link-root"
    link_root.symlink_to(cache)
    result = kvtier("inspect", link_root)
    assert result.returncode == 2 and "symlink" in result.stderr


def test_a_missing_root_is_a_clear_error(tmp_path):
    result = kvtier("verify", tmp_path / "nope")
    assert result.returncode == 2 and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_gpu_without_a_gpu_says_so(tmp_path):
    result = kvtier("gpu")
    if result.returncode == 0:
        pytest.skip("this machine has a GPU")
    assert result.returncode == 1 and "gpu:" in result.stderr and "Traceback" not in result.stderr
    code, data = as_json("gpu")
    assert code == 1 and data["gpus"] == [] and data["error"]


def test_bench_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "out"
    result = kvtier("bench", "--model", "custom", "--layers", "2", "--kv-heads", "2",
                    "--head-dim", "64", "--chunk-tokens", "64", "--size", "4MiB", "--depths", "1,2",
                    "--prompt-tokens", "1024,4096", "--prefill-tps", "5000",
                    "--disk-path", tmp_path / "disk", "--out", out)
    assert result.returncode == 0, result.stderr
    assert "kvtier bench: custom" in result.stdout and "TTFT estimate" in result.stdout
    data = json.loads((out / "bench.json").read_text())
    assert data["chunk_bytes"] == 2 * 2 * 2 * 64 * 2 * 64
    assert data["host"]["store_gib_s"] > 0 and data["host"]["load_latency"]["p99_ms"] > 0
    assert [row["depth"] for row in data["disk"]["depths"]] == [1, 2]
    assert all(row["load_gib_s"] > 0 and row["store_latency"]["p50_ms"] > 0
               for row in data["disk"]["depths"])
    assert data["disk"]["naive"]["load_gib_s"] > 0
    if data["disk"]["fio"]:
        assert all(row["load_vs_fio"] > 0 for row in data["disk"]["depths"])
    ttft = data["ttft"]
    assert ttft["prefill_tps"] == 5000 and not ttft["prefill_assumed"]
    assert [row["tokens"] for row in ttft["rows"]] == [1024, 4096]
    assert ttft["rows"][0]["recompute_s"] == pytest.approx(1024 / 5000)
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "disk").iterdir()) == []  # cleaned up after itself


def test_bench_stripes_over_several_disk_paths(tmp_path):
    out = tmp_path / "out"
    result = kvtier("bench", "--model", "custom", "--layers", "2", "--kv-heads", "2",
                    "--head-dim", "64", "--chunk-tokens", "64", "--size", "4MiB", "--depths", "2",
                    "--disk-path", tmp_path / "a", "--disk-path", tmp_path / "b", "--no-baselines",
                    "--duration", "1s",
                    "--out", out, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "bench.json").read_text())
    assert len(data["disk_paths"]) == 2 and data["disk"]["depths"][0]["load_gib_s"] > 0
    assert data["disk"]["naive"] is None and "load_vs_fio" not in data["disk"]["depths"][0]


def test_bench_refuses_an_unknown_model(tmp_path):
    result = kvtier("bench", "--model", "gpt-9", "--out", tmp_path)
    assert result.returncode == 2 and "presets" in result.stderr


def test_a_store_serves_metrics_that_stats_prints(tmp_path):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "m").mkdir(mode=0o700)
    with KVStore(SMALL, {**config(tmp_path / "m"), "metrics_port": port}) as store:
        store.put(seq(0, 3), make_kv(seq(0, 3)))
        store.flush()
        out = torch_zeros(3)
        store.get(seq(0, 3), out)
        store.get(seq(9000, 1), torch_zeros(1))
        code, data = as_json("stats", f"127.0.0.1:{port}")
        table = kvtier("stats", f"http://127.0.0.1:{port}/metrics")
    assert code == 0 and table.returncode == 0 and "chunks_stored_total" in table.stdout
    values = {(s["name"], tuple(sorted(s["labels"].items()))): s["value"] for s in data["samples"]}
    assert values[("kvtier_chunks_stored_total", ())] == 3
    assert values[("kvtier_chunks_loaded_total", (("tier", "host"),))] == 3
    assert values[("kvtier_chunks_missed_total", ())] == 1
    assert values[("kvtier_disk_bytes_total", (("direction", "write"),))] == 3 * STRIDE
    assert values[("kvtier_slots", (("tier", "disk"),))] == 64
    assert values[("kvtier_used_slots", (("tier", "host"),))] == 3


def test_stats_of_a_dead_address_is_a_clear_error():
    result = kvtier("stats", "127.0.0.1:9")
    assert result.returncode == 1 and "cannot read metrics" in result.stderr


def torch_zeros(chunks):
    import torch

    return torch.zeros(SMALL.shape(chunks * 16), dtype=torch.bfloat16)
