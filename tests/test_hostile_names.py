"""Names and numbers read from a hostile cache root: a file is kvtier's only under the very
name kvtier writes, and a lease, an index entry or a ``namespace.json`` holding numbers or
text kvtier never writes reads as damaged; nothing crashes the engine, the shared view or a
command, and no file kvtier did not name is read as one of its own, truncated or deleted."""

import json
import os
from types import SimpleNamespace

import pytest

from kvtier import KVStore
from kvtier.config.settings import load_config
from kvtier.connector.common.engine_writer import engine_writers
from kvtier.io.format import INDEX_ENTRY_BYTES, SlotHeader, decode_header
from kvtier.io.safefs import SafeDir
from kvtier.keys import namespace_id_of
from kvtier.ops.cache import namespaces
from kvtier.segment import seat_orphans, seats
from kvtier.segment.index_file import valid_header
from kvtier.segment.lease import LeaseInfo
from kvtier.segment.names import TEMP_NAME, seat_number, slot_number, writer_ids
from kvtier.shared.view import SharedView
from tests.helpers.hostile import cli, make_cache, namespace_of, seat_file, stopped_writer_namespace
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.shared import shared
from tests.helpers.store import config, exact, seq

LEASE = {"instance": "a", "host": "h", "pid": 1, "beat": 2, "started_ns": 3, "written_ns": 4}


def as_json(code_output):
    code, output = code_output
    return code, json.loads(output[output.index("{"):])


# -- leases ---------------------------------------------------------------------------------


@pytest.mark.parametrize("field,text", [
    ("pid", "1e400"), ("pid", "Infinity"), ("written_ns", str(10**400)), ("beat", "true"),
    ("beat", "-1"), ("started_ns", "1.5"), ("written_ns", str(2**63)), ("pid", '"12"'),
    ("ppid", "NaN"), ("ppid", "null"), ("instance", "7"), ("host", "[1]"),
])
def test_a_lease_with_a_number_or_text_kvtier_never_writes_is_no_lease(field, text):
    good = json.dumps(LEASE)
    assert LeaseInfo.parse(good.encode()) == LeaseInfo("a", "h", 1, 2, 3, 4)
    fields = {**LEASE, field: "@"}
    assert LeaseInfo.parse(json.dumps(fields).replace('"@"', text).encode()) is None
    assert LeaseInfo.parse(b"[1, 2]") is None and LeaseInfo.parse(b'"lease"') is None


def test_a_lease_of_huge_numbers_never_stops_the_engine_the_view_or_a_command(tmp_path):
    root = tmp_path / "cache"
    segment = make_cache(root, instance_id="a")
    lease = json.loads((segment / "lease").read_text())
    text = json.dumps({**lease, "pid": "@"}).replace('"@"', "1e400")
    (segment / "lease").write_text(text)  # a stopped writer's lease, damaged
    with KVStore(SMALL, config(root, instance_id="b", share_writers=4,
                               share_refresh="1h")) as b:  # refreshed once, as it opens
        assert exact(b, seq(0, 3)) == 3 * CHUNK  # a's chunks are followed all the same
        namespace = b.namespace
        assert [w.lease for w in b.writers() if w.writer == "a"] == [None]  # damaged: none
    plain = load_config({"disk_paths": [str(root)], "chunk_tokens": CHUNK}, environ={})
    assert engine_writers(plain, [namespace]) == [writer_ids(None)[0]]  # no process holds it
    (segment / "lease").write_text(json.dumps({**lease, "host": "elsewhere",
                                               "written_ns": 10**400}))
    code, report = as_json(cli("inspect", root, "--json"))
    (writer,) = [w for w in report["namespaces"][0]["writers"] if w["writer"] == "a"]
    assert code == 0 and writer["host"] == "" and writer["lease_age_seconds"] is None
    for args in (("gc", root, "--gone", "1d"), ("gc", root, "--older-than", "1d"),
                 ("clear", root, "--yes")):
        assert cli(*args)[0] in (0, 1)  # cli() fails on any exception or traceback
    assert not segment.exists()  # a lease that says nothing keeps no segment in use


# -- names ----------------------------------------------------------------------------------


def test_only_the_names_kvtier_writes_count_as_its_slot_seat_and_temporary_files():
    assert [slot_number(n) for n in ("slots-0000.kvt", "slots-0042.kvt", "slots-12345.kvt")] \
        == [0, 42, 12345]
    for name in ("slots-00000.kvt", "slots-01234.kvt", "slots-\u0661\u0662\u0663\u0664.kvt",
                 "slots-0000.kvt\n", "slots-123.kvt", "slots-\uff10\uff10\uff10\uff10.kvt"):
        assert slot_number(name) is None, name
    assert seat_number("seat-0007") == 7
    for name in ("seat-00007", "seat-\u0660\u0660\u0660\u0667", "seat-7", "seat-0007 "):
        assert seat_number(name) is None, name
    assert TEMP_NAME.fullmatch(".lease.tmp-4242-0badc0de")
    assert TEMP_NAME.fullmatch(".seat.tmp-4242-0badc0de")
    for name in (".lease.tmp-\u0664\u0662-0badc0de", ".lease.tmp-0042-0badc0de",
                 ".o_direct_probe-4242-0BADC0DE", ".lease.tmp-4242-0badc0de.keep"):
        assert not TEMP_NAME.fullmatch(name), name


def test_files_named_almost_like_slot_files_are_never_read_trimmed_or_deleted(tmp_path):
    root = tmp_path / "cache"
    segment = make_cache(root)
    impostors = {segment / "slots-00000.kvt": b"not kvtier's data\n",  # number 0 again
                 segment / "slots-00063.kvt": b"past the capacity: would be cut to nothing",
                 segment / "slots-\u0661\u0662\u0663\u0664.kvt": b"Arabic-Indic digits"}
    for path, data in impostors.items():
        path.write_bytes(data)
        os.chmod(path, 0o600)
    code, report = as_json(cli("verify", root, "--json"))
    (writer,) = report["namespaces"][0]["writers"]
    assert code == 0 and writer["ok"] == 3 and writer["stale_index"] == []
    assert cli("verify", root, "--repair")[0] == 0
    with KVStore(SMALL, config(root, share_writers=4)) as store:  # opening trims slot files
        assert store.stats().recovered_chunks == 3 and exact(store, seq(0, 3)) == 3 * CHUNK
    code, report = as_json(cli("clear", root, "--yes", "--json"))
    assert code == 1 and sorted(report["left"][f"{namespace_of(segment).name}/writers/"
                                               f"{segment.name}"]) == sorted(p.name for p in impostors)
    assert {path: path.read_bytes() for path in impostors} == impostors


# -- generations ----------------------------------------------------------------------------


def test_an_index_entry_of_generation_near_2_64_never_stops_the_writer(tmp_path):
    root = tmp_path / "cache"
    segment = make_cache(root)
    index = bytearray((segment / "index.kvt").read_bytes())
    h = decode_header(bytes(index[:INDEX_ENTRY_BYTES]))
    huge = SlotHeader(h.namespace, h.key, h.codec, h.payload_bytes, h.raw_bytes,
                      h.payload_checksum, 2**64 - 1, h.created_ns).encode()
    index[:INDEX_ENTRY_BYTES] = huge[:INDEX_ENTRY_BYTES]  # checksum-valid
    (segment / "index.kvt").write_bytes(bytes(index))
    assert decode_header(huge).generation == 2**64 - 1
    with KVStore(SMALL, config(root, share_writers=4)) as store:
        assert store.stats().recovered_chunks == 2  # the absurd entry is not trusted
        fresh = seq(5000, 3)
        store.put(fresh, make_kv(fresh))
        assert store.flush() and store.stats().io_errors == 0
    with KVStore(SMALL, config(root, share_writers=4, host_chunks=1)) as store:
        assert exact(store, fresh) == 3 * CHUNK


def test_valid_header_refuses_generations_from_2_63_on(tmp_path):
    from kvtier.segment.index_file import SlotLayout

    segment = make_cache(tmp_path / "cache")
    entry = (segment / "index.kvt").read_bytes()[:INDEX_ENTRY_BYTES]
    h = decode_header(entry)
    layout = SlotLayout(h.raw_bytes, 1, 0)
    for generation, kept in ((2**63 - 1, True), (2**63, False), (2**64 - 1, False)):
        data = SlotHeader(h.namespace, h.key, h.codec, h.payload_bytes, h.raw_bytes,
                          h.payload_checksum, generation, h.created_ns).encode()
        assert (valid_header(data, h.namespace, layout) is not None) is kept, generation


# -- namespace.json -------------------------------------------------------------------------


@pytest.mark.parametrize("described", ["not json", "[" * 100_000, "\ud800"])
def test_a_namespace_json_describing_a_namespace_that_is_not_json_reads_as_damaged(
        tmp_path, described):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    try:
        name = namespace_id_of(described)
    except UnicodeEncodeError:
        name = "ab" * 16  # not text: no directory can be named after it
    (root / name).mkdir(mode=0o700)
    meta = root / name / "namespace.json"
    meta.write_text(json.dumps({"namespace": described, "stride": 8192, "raw_bytes": 4096,
                                "file_slots": 1}))
    os.chmod(meta, 0o600)
    (found,) = namespaces(root)
    assert found.status == "damaged" and "namespace.json" in found.problem
    code, report = as_json(cli("inspect", root, "--json"))
    assert code == 1 and report["namespaces"][0]["status"] == "damaged"  # a problem found
    for args in (("verify", root), ("gc", root, "--older-than", "1d"), ("clear", root, "--yes")):
        assert cli(*args)[0] in (0, 1)
    assert meta.exists()  # damaged: not provably kvtier's, left alone


# -- seats --------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"ghost", b"\xff" * 300])
@pytest.mark.parametrize("skew_s", [3600, -3600])
def test_a_seat_naming_no_writer_with_a_segment_is_given_back_once_watched_that_long(
        tmp_path, content, skew_s):
    """Empty (a crash between making a seat and writing it), a writer that never made its
    segment, or unreadable: no writer would ever free it, and with share_writers=1 it keeps
    every writer out. Given back once this reader watched it stand unchanged for
    lease_timeout, never before, whatever its file times say: a seat just made by a host
    whose clock is an hour behind looks an hour old (it was freed at the first look), and
    one from a host an hour ahead was kept for that hour."""
    ns = stopped_writer_namespace(tmp_path)
    quick = {"share_writers": 1, "lease_timeout": "2s", "share_refresh": "1h"}
    seat = seat_file(ns, content, age_s=skew_s)
    now = [0.0]  # the reader's clock, moved by hand
    with KVStore(SMALL, shared(tmp_path, "b", **quick)) as b:  # looks at the seats as it opens
        view = SharedView([str(tmp_path)], b.namespace, b.chunk_bytes, ("b",), 2.0,
                          clock=lambda: now[0])
        view.refresh()
        assert b.stats().paths_down and seat.exists()  # it may be a seat being made right now
        now[0] += 1.0
        view.refresh()
        assert seat.exists() and view.seats_freed == 0
        now[0] += 1.1
        view.refresh()
        assert not seat.exists() and view.seats_freed == 1
        view.close()
    with KVStore(SMALL, shared(tmp_path, "c", share_writers=1, share_refresh="off")) as c:
        assert c.stats().paths_down == {}  # the seat is free again
    assert seat.read_text() == "c"


def test_a_reader_watches_orphan_seats_by_its_own_clock():
    """``OrphanWatch``: due once seen unchanged at every look for the timeout; a seat that
    changed (touched by a writer taking it again) or was missing from a look starts over."""
    now = [0.0]
    watch = seat_orphans.OrphanWatch(10.0, clock=lambda: now[0])
    a = SimpleNamespace(st_ino=1, st_mtime_ns=0, st_size=5, st_nlink=1)
    b = SimpleNamespace(st_ino=2, st_mtime_ns=0, st_size=5, st_nlink=1)
    assert watch.due([("seat-0000", a), ("seat-0001", b)]) == []
    now[0] = 6.0
    touched = SimpleNamespace(st_ino=1, st_mtime_ns=7, st_size=5, st_nlink=1)
    assert watch.due([("seat-0000", touched)]) == []  # seat-0001 missing from this look
    now[0] = 12.0
    assert watch.due([("seat-0000", touched), ("seat-0001", b)]) == []
    now[0] = 16.0
    assert watch.due([("seat-0000", touched), ("seat-0001", b)]) == [("seat-0000", touched)]
    now[0] = 22.0
    assert [n for n, _ in watch.due([("seat-0000", touched), ("seat-0001", b)])] == [
        "seat-0000", "seat-0001"]


def test_a_seat_whose_writer_has_a_segment_is_kept_however_old(tmp_path):
    with KVStore(SMALL, shared(tmp_path, "a", share_writers=1)):
        pass
    (ns,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    seat = seat_file(ns, b"a", age_s=3600)
    with SafeDir.open(ns) as ns_dir:
        assert seat_orphans.free_orphan_seats(ns_dir, 2.0) == [] and seat.read_text() == "a"


def test_a_seat_is_made_whole_or_not_at_all(tmp_path, monkeypatch):
    ns = stopped_writer_namespace(tmp_path)

    def crash(fd):
        raise OSError(5, "the process died here")

    monkeypatch.setattr(seats.os, "fsync", crash)
    with SafeDir.open(ns) as ns_dir, pytest.raises(OSError):
        seats.claim_seat(ns_dir, "a", 1)
    monkeypatch.undo()
    assert os.listdir(ns / "seats") == []  # no empty seat, no temporary file
    temp = seat_file(ns, b"a", name=".seat.tmp-4242-0badc0de")  # linked, then a crash
    os.link(temp, ns / "seats" / "seat-0000")
    with SafeDir.open(ns) as ns_dir:
        assert seats.claim_seat(ns_dir, "a", 1) == 0  # its own seat, read again
        with ns_dir.subdir("seats") as seats_dir:
            assert not seats.write_seat(seats_dir, "seat-0000", "b")  # never replaced
    assert os.listdir(ns / "seats") == ["seat-0000"] and temp.with_name("seat-0000").read_text() == "a"


def test_reclaiming_removes_what_a_writer_killed_in_its_o_direct_probe_left(tmp_path):
    with KVStore(SMALL, shared(tmp_path, "a", share_writers=1)) as a:
        a.put(seq(0, 2), make_kv(seq(0, 2)))
        a.flush()
    (segment,) = tmp_path.glob("*/writers/a")
    probe = segment / ".o_direct_probe-4242-0badc0de"
    probe.write_bytes(bytes(4096))
    os.chmod(probe, 0o600)
    with SafeDir.open(segment.parents[1]) as ns_dir:
        assert seats.reclaim_segment(ns_dir, "a", segment.stat().st_ino)
    assert not segment.exists() and not list(tmp_path.glob("*/seats/seat-*"))


def test_a_forged_lease_beside_a_lock_that_cannot_be_tried_is_never_this_engines_segment(tmp_path):
    """A co-writer's segment (first by name) with a lease naming this host and process and a
    directory for its lock (which cannot be tried: "held", cautiously) must not be taken for
    this engine's own: the scheduler side would read its index as this engine's."""

    from kvtier.segment.names import host_name
    from tests.helpers.disk_helpers import NS, lock_held_elsewhere

    root = tmp_path / "cache"
    writers = root / NS.id / "writers"
    real, forged = writers / f"{host_name()}-0", writers / "0000"
    for segment in (real, forged):
        segment.mkdir(parents=True, mode=0o700)
        (segment / "lease").write_text(json.dumps({
            "instance": segment.name, "host": host_name(), "pid": os.getpid(), "beat": 1,
            "started_ns": 1, "written_ns": 1}))
    for directory in (root, root / NS.id, writers):
        os.chmod(directory, 0o700)
    (forged / "lock").mkdir(mode=0o700)
    (real / "lock").touch(mode=0o600)
    with lock_held_elsewhere(real):  # this engine's worker holds its real segment's lock
        config = load_config({"disk_paths": [str(root)], "chunk_tokens": CHUNK}, environ={})
        assert engine_writers(config, [NS]) == [real.name]


def test_junk_in_seats_costs_an_engines_look_no_more_than_its_bound(tmp_path, monkeypatch):
    """An engine looks at the first ``LISTED`` entries of ``seats/`` and stats only those
    named as seats or their temporary files: a co-writer filling it with junk makes each
    look cost no more (the CLI's ``gc`` still looks at every entry)."""
    with KVStore(SMALL, shared(tmp_path, "a", share_writers=1)):
        pass
    (ns,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    for n in range(300):
        (ns / "seats" / f"junk-{n:04d}").touch(mode=0o600)
    orphan = seat_file(ns, b"", name="seat-0003")  # names no writer
    stats: list[str] = []
    real = SafeDir.lstat
    monkeypatch.setattr(SafeDir, "lstat", lambda self, name: stats.append(name) or real(self, name))
    with SafeDir.open(ns) as ns_dir:
        stats.clear()
        found = seat_orphans.orphan_seats(ns_dir, None, limit=64)
        assert not any(name.startswith("junk") for name in stats) and len(stats) <= 64 + 1
        assert [n for n, _ in seat_orphans.orphan_seats(ns_dir, None)] == [orphan.name]
        assert [n for n, _ in found] in ([], [orphan.name])  # within the first 64, or not
