"""``kvtier clear`` removes only what kvtier provably wrote, by the rule ``inspect`` and
``gc`` apply (``kvtier.ops.provenance``; issue 40, finding 12): a namespace whose
``namespace.json`` is not JSON is damaged and a segment whose lease is larger than kvtier
writes is unsafe, so both stay whole, and ``clear`` says which and why; a healthy namespace
beside them still goes."""

import json
import os
import shutil

import numpy as np
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.ops.cache import cache_root, namespaces, slot_file_sizes
from kvtier.ops.segments import index_entries
from kvtier.ops.slot_freeing import free_slots
from kvtier.segment.lease import MAX_LEASE_BYTES
from tests.helpers.hostile import label, make_cache, namespace_of, tree_digest
from tests.helpers.store import STRIDE


def kvtier(*args):
    """``kvtier ARGS`` in this process: (exit code, stdout); no exception escapes."""
    clean = {k: None for k in os.environ if k.startswith("KVTIER_")}
    result = CliRunner().invoke(app, [str(a) for a in args], env=clean)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout


def report(*args):
    code, out = kvtier(*args, "--json")
    return code, json.loads(out)


def three_namespaces(root):
    """Under ``root``: a namespace whose namespace.json is not JSON (its slots still prove it
    kvtier's), one whose segment's lease is larger than kvtier writes, and a healthy one;
    their segment directories."""
    damaged = make_cache(root, 2, model="damaged-model")
    (namespace_of(damaged) / "namespace.json").write_text("{ not json")
    oversized = make_cache(root, 2, model="oversized-lease-model")
    (oversized / "lease").write_bytes(b"x" * (MAX_LEASE_BYTES + 1))
    healthy = make_cache(root, 2, model="healthy-model")
    return damaged, oversized, healthy


def test_inspect_and_gc_judge_both_left_alone(tmp_path):
    damaged, oversized, _ = three_namespaces(tmp_path)
    code, data = report("inspect", tmp_path)
    status = {ns["id"]: ns["status"] for ns in data["namespaces"]}
    assert code == 1 and status[namespace_of(damaged).name] == "damaged"
    assert status[namespace_of(oversized).name] == "unsafe"
    code, data = report("gc", tmp_path, "--stale", "--older-than", "0s", "--dry-run")
    assert data["skipped_unsafe"] == [label(oversized)] and not data["namespaces_removed"]
    assert namespace_of(damaged).name in data["unreadable"]


def test_clear_leaves_a_damaged_and_an_unsafe_namespace_and_clears_the_healthy_one(tmp_path):
    damaged, oversized, healthy = three_namespaces(tmp_path)
    kept = {path: tree_digest(namespace_of(path)) for path in (damaged, oversized)}
    code, data = report("clear", tmp_path, "--yes")
    assert code == 1
    assert data["removed"] == [namespace_of(healthy).name] and not namespace_of(healthy).exists()
    assert {path: tree_digest(namespace_of(path)) for path in (damaged, oversized)} == kept
    why_damaged = data["reasons"][namespace_of(damaged).name]
    assert "damaged" in why_damaged and "not JSON" in why_damaged
    why_unsafe = data["reasons"][label(oversized)]
    assert f"{oversized}/lease" in why_unsafe and f"{MAX_LEASE_BYTES + 1} bytes" in why_unsafe
    assert set(data["left"]) == {namespace_of(damaged).name, label(oversized)}


def test_clear_says_what_it_left_and_why(tmp_path):
    damaged, oversized, _ = three_namespaces(tmp_path)
    code, out = kvtier("clear", tmp_path, "--yes")
    text = " ".join(out.split())  # as one line, however the console wrapped it
    assert code == 1 and text.startswith("removed 1 namespace(s), 1 writer segment(s)")
    assert f"{namespace_of(damaged).name[:12]}: left alone: damaged (namespace.json: not JSON" in text
    assert f"{namespace_of(oversized).name[:12]}/writers/{oversized.name}: left alone: " \
           f"{oversized}/lease is {MAX_LEASE_BYTES + 1} bytes" in text


def test_clear_removes_a_segments_slot_files_before_its_index(tmp_path, monkeypatch):
    """A clear killed midway must not leave slot files without their index: the next start
    scans their headers and takes every chunk back. Found by a review."""
    from kvtier.io.safefs import SafeDir

    make_cache(tmp_path, 2, model="order-model")
    removed, real = [], SafeDir.remove_file

    def recording(self, name):
        removed.append(name)
        return real(self, name)

    monkeypatch.setattr(SafeDir, "remove_file", recording)
    assert kvtier("clear", tmp_path, "--yes")[0] == 0
    slots = [i for i, name in enumerate(removed) if name.startswith("slots-")]
    assert slots and "index.kvt" in removed and max(slots) < removed.index("index.kvt")


# ---- a namespace that lost its namespace.json: proven kvtier's by its slots or its index ---


def orphan(root, chunks, **extra):
    """A namespace of ``chunks`` chunks under ``root`` whose namespace.json is gone; its
    segment directory."""
    segment = make_cache(root, chunks, **extra)
    (namespace_of(segment) / "namespace.json").unlink()
    return segment


def blank_header(path, offset):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(4096), offset)
    finally:
        os.close(fd)


def first_data(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_DATA)
    finally:
        os.close(fd)


def test_an_orphan_whose_first_slot_was_freed_is_proven_by_a_later_one(tmp_path):
    segment = make_cache(tmp_path, 6, model="freed-head-model")
    (ns,) = namespaces(cache_root(tmp_path))
    with ns.segments[0].open() as handle:
        entries = dict(index_entries(ns.segments[0], handle, slot_file_sizes(ns.segments[0].meta, handle)))
    freed: list[int] = []
    assert free_slots(ns.segments[0], np.array([0]), np.array([entries[0].generation], np.uint64),
                      freed) == ""  # as gc frees it
    assert freed == [0] and first_data(segment / "slots-0000.kvt") > 0  # slot 0 is a hole
    (namespace_of(segment) / "namespace.json").unlink()
    (segment / "index.kvt").unlink()  # only the slots themselves can prove it
    code, data = report("clear", tmp_path, "--yes")
    assert code == 0 and data["removed"] == [namespace_of(segment).name]
    assert not namespace_of(segment).exists()


def test_an_orphan_whose_slot_headers_are_blank_is_proven_by_its_index(tmp_path):
    segment = orphan(tmp_path, 3, model="blank-headers-model")
    for slot in range(3):
        blank_header(segment / "slots-0000.kvt", slot * STRIDE)
    code, data = report("gc", tmp_path, "--stale")
    assert code == 0 and data["namespaces_removed"] == [namespace_of(segment).name]
    assert not namespace_of(segment).exists()


def test_an_orphan_holding_another_namespaces_slots_and_index_is_not_proven(tmp_path):
    other = make_cache(tmp_path, 3, model="other-model")
    segment = orphan(tmp_path, 3, model="copied-model")
    for name in ("slots-0000.kvt", "index.kvt"):
        shutil.copyfile(other / name, segment / name)
    blank_header(segment / "slots-0000.kvt", 0)
    kept = tree_digest(namespace_of(segment))
    code, data = report("clear", tmp_path, "--yes")
    assert code == 1 and data["removed"] == [namespace_of(other).name]
    assert "no slot header or index entry proves it kvtier's" in \
        data["reasons"][namespace_of(segment).name]
    assert tree_digest(namespace_of(segment)) == kept


def test_clear_keeps_only_the_unsafe_segment_of_a_namespace_inspect_calls_unsafe(tmp_path):
    good = make_cache(tmp_path, 2, instance_id="good-0", share_writers=2)
    bad = make_cache(tmp_path, 2, instance_id="bad-0", share_writers=2)
    os.mkfifo(bad / "slots-0001.kvt")
    code, data = report("inspect", tmp_path)
    assert code == 1 and data["namespaces"][0]["status"] == "unsafe"
    kept = tree_digest(bad)
    code, data = report("clear", tmp_path, "--yes")
    assert code == 1 and data["segments_removed"] == [label(good)] and not data["removed"]
    assert f"{bad}/slots-0001.kvt is a FIFO" in data["reasons"][label(bad)]
    assert not good.exists() and tree_digest(bad) == kept
    assert (namespace_of(bad) / "namespace.json").exists()
