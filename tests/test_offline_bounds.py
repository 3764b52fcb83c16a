"""The offline commands (``inspect``, ``verify``, ``gc``, ``clear PATH``) list every directory of
a cache root up to a bound: a directory a hostile co-writer stuffed with entries costs them a
bounded listing. Past its bound a directory is reported, naming it and the bound, in the
text and in ``--json``, skipped, and the command exits 1; nothing in it is deleted. The
bounds are set low here (``kvtier.ops.listing``) rather than directories made huge."""

import json
import os
import time

import pytest

from kvtier.io.safefs import SafeDir
from kvtier.ops import listing
from kvtier.segment import seat_orphans, seats
from tests.helpers.hostile import cli, label, make_cache, namespace_of, tree_digest

BOUND = 8


def stuff(directory, count: int, make=lambda path: path.write_bytes(b"")) -> None:
    for i in range(count):
        make(directory / f"junk-{i}")


def report(*args):
    code, output = cli(*args, "--json")
    return code, json.loads(output[output.index("{"):])


def text(*args):
    return cli(*args)


def gone(segment) -> None:
    """Make the writer of ``segment`` (a store of this process, closed) gone for two hours."""
    old = time.time_ns() - 2 * 3600 * 10**9
    lease = json.loads((segment / "lease").read_text())
    lease.update(written_ns=old, started_ns=old - 10**9)
    (segment / "lease").write_text(json.dumps(lease))
    os.utime(segment / "lease", ns=(old, old))
    os.utime(segment, ns=(old, old))


@pytest.fixture
def unbounded_listing_fails(monkeypatch):
    """Any listing of a whole directory, without a bound, fails the test."""
    def refused(*args, **kwargs):
        raise AssertionError("a directory was listed without a bound")

    monkeypatch.setattr(SafeDir, "names", refused, raising=False)
    monkeypatch.setattr(os, "listdir", refused)


COMMANDS = [("inspect",), ("verify",), ("verify", "--repair"), ("gc", "--older-than", "100d"),
            ("gc", "--gone", "1h", "--dry-run"), ("gc", "--gone", "1h"), ("gc", "--stale"),
            ("gc", "--target", "0", "--dry-run")]


def test_every_listing_of_the_offline_commands_is_bounded(tmp_path, unbounded_listing_fails):
    root = tmp_path / "cache"
    segment = make_cache(root, instance_id="a")
    make_cache(root, instance_id="b")
    gone(segment)
    for command in COMMANDS:
        code, found = report(command[0], root, *command[1:])
        assert code == 0, (command, found)
    assert not segment.exists()  # gc --gone removed it, its seat given back
    code, done = report("clear", root, "--yes")
    assert code == 0 and len(done["removed"]) == 1
    with os.scandir(root) as left:
        assert [entry.name for entry in left] == []


def test_a_stuffed_cache_root_is_reported_and_its_namespaces_not_looked_at(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    segment = make_cache(root)
    ns_id = namespace_of(segment).name
    monkeypatch.setattr(listing, "ROOT_LISTED", BOUND)
    stuff(root, BOUND)
    before = tree_digest(root)
    why = f"{root} holds more than {BOUND} entries"
    for command in [("inspect",), ("verify",), ("gc", "--older-than", "0s"), ("clear", "--yes")]:
        code, found = report(command[0], root, *command[1:])
        assert code == 1 and why in found["problem"], (command, found)
        code, output = text(command[0], root, *command[1:])
        assert code == 1 and why in " ".join(output.split()), (command, output)
    assert tree_digest(root) == before
    code, found = report("inspect", root, "--namespace", ns_id)  # looked up by its name
    assert code == 0 and found["problem"] == "" and [n["id"] for n in found["namespaces"]] == [ns_id]
    code, freed = report("gc", root, "--namespace", ns_id, "--older-than", "0s")
    assert code == 0 and freed["chunks_freed"] == 3


def test_a_stuffed_writers_directory_leaves_its_namespace_alone(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    segment = make_cache(root)
    gone(segment)
    writers = segment.parent
    monkeypatch.setattr(listing, "WRITERS_LISTED", BOUND)
    stuff(writers, BOUND, lambda path: path.mkdir())
    before = tree_digest(root)
    why = f"{writers} holds more than {BOUND} entries"
    code, found = report("inspect", root)
    (ns,) = found["namespaces"]
    assert code == 1 and ns["status"] == "unsafe" and why in ns["problem"], ns
    assert why in " ".join(text("inspect", root)[1].split())
    code, checked = report("verify", root)
    assert code == 1 and why in checked["namespaces"][0]["problem"]
    for args in (("--older-than", "0s"), ("--gone", "1h")):
        code, freed = report("gc", root, *args)
        ns_id = ns["id"]
        assert code == 1 and freed["skipped_unsafe"] == [ns_id] and why in freed["reasons"][ns_id]
        assert freed["chunks_freed"] == 0 and freed["segments_removed"] == []
    code, done = report("clear", root, "--yes")
    assert code == 1 and done["removed"] == [] and why in done["reasons"][ns["id"]]
    assert tree_digest(root) == before


def test_a_stuffed_segment_is_left_alone(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    segment = make_cache(root)
    gone(segment)
    monkeypatch.setattr(listing, "SEGMENT_LISTED", BOUND)
    stuff(segment, BOUND)
    before = tree_digest(root)
    why = f"{segment} holds more than {BOUND} entries"
    code, found = report("inspect", root)
    (writer,) = found["namespaces"][0]["writers"]
    assert code == 1 and writer["status"] == "unsafe" and why in writer["problem"], writer
    code, checked = report("verify", root)
    assert code == 1 and why in checked["namespaces"][0]["writers"][0]["problem"]
    for args in (("--older-than", "0s"), ("--gone", "1h")):
        code, freed = report("gc", root, *args)
        assert code == 1 and freed["skipped_unsafe"] == [label(segment)], freed
        assert why in freed["reasons"][label(segment)] and freed["chunks_freed"] == 0
    code, done = report("clear", root, "--yes")
    assert code == 1 and why in done["left"][label(segment)][0]
    assert tree_digest(root) == before


@pytest.fixture
def seats_bound(monkeypatch):
    for module in (listing, seat_orphans, seats):
        monkeypatch.setattr(module, "SEATS_LISTED", BOUND)


def test_a_stuffed_seats_directory_keeps_every_segment_and_seat(tmp_path, seats_bound):
    root = tmp_path / "cache"
    segment = make_cache(root)
    gone(segment)
    ns = namespace_of(segment)
    stuff(ns / "seats", BOUND)
    before = tree_digest(root)
    why = f"{ns / 'seats'} holds more than {BOUND} entries"
    for args in (("--gone", "1h", "--dry-run"), ("--gone", "1h")):
        code, freed = report("gc", root, *args)
        assert code == 1 and freed["segments_removed"] == [], freed
        assert why in freed["left"][f"{ns.name}/seats"][0]
    code, done = report("clear", root, "--yes")
    assert code == 1 and done["removed"] == [] and why in done["left"][ns.name][0], done
    assert tree_digest(root) == before


def test_a_stuffed_namespace_directory(tmp_path, monkeypatch):
    """A namespace directory of this version is not listed to be found: one stuffed is
    inspected; ``clear`` removes its segments and reports what it could not list. One of
    format version 1 (slot files in it, no ``namespace.json``) is reported."""
    root = tmp_path / "cache"
    segment = make_cache(root)
    ns = namespace_of(segment)
    monkeypatch.setattr(listing, "NAMESPACE_LISTED", BOUND)
    stuff(ns, BOUND)
    old = root / ("0" * 32)
    old.mkdir(mode=0o700)
    (old / "slots-0000.kvt").write_bytes(b"")
    stuff(old, BOUND)
    code, found = report("inspect", root)
    by_id = {n["id"]: n for n in found["namespaces"]}
    assert code == 1 and by_id[ns.name]["status"] == "ok"
    assert by_id[old.name]["status"] == "unsafe"
    assert f"{old} holds more than {BOUND} entries" in by_id[old.name]["problem"]
    code, done = report("clear", root, "--yes", "--namespace", ns.name)
    assert code == 1 and f"{ns} holds more than {BOUND} entries" in done["left"][ns.name][0]
    assert (ns / "namespace.json").exists() and all((ns / f"junk-{i}").exists() for i in range(BOUND))
    assert len(list((old).iterdir())) == BOUND + 1
