"""A chunk removed on purpose stays removed. A removal blanks the slot's index entry (and logs
it) before the slot's header, so that engines reading the segment stop before the header
changes; the entry becomes the header's tombstone (``mark_removed``), and ``kvtier verify
--repair`` finishes a removal killed in between instead of indexing the chunk again. Every
reader, of any version, takes a tombstone for a blank entry."""

import json
import subprocess
import sys
import textwrap

import numpy as np

from kvtier import KVStore
from kvtier.io.format import INDEX_ENTRY_BYTES, is_blank
from kvtier.io.safefs import SafeDir
from kvtier.segment.index_file import SlotLayout, parse_index, written_index_entries
from kvtier.segment.log import LogFollower
from tests.helpers.hostile import cli, segment_dir
from tests.helpers.kv import CHUNK, SMALL
from tests.helpers.store import config, exact, seq
from tests.helpers.vllm_engine import ROOT

KILLED = 9


def _child(root, body: str) -> int:
    """Run ``body`` in a process of its own over the cache at ``root`` (``cfg``, ``tokens``:
    two chunks); its exit code (``KILLED``: it was killed where ``kill_at`` says)."""
    script = textwrap.dedent("""
        import os, sys
        from kvtier import KVStore
        from tests.helpers.kv import CHUNK, SMALL, make_kv
        from tests.helpers.store import config, seq
        cfg, tokens = config(sys.argv[1], disk_chunks=2), seq(0, 2)
    """) + textwrap.dedent(body) + "\nos._exit(1)\n"
    return subprocess.run([sys.executable, "-c", script, str(root)], cwd=ROOT,
                          timeout=120).returncode


_STORED = """
    with KVStore(SMALL, cfg) as store:  # both chunks on disk, then only there
        store.put(tokens, make_kv(tokens))
        assert store.flush()
"""

_REMOVE_SECOND_KILLED_BEFORE_ITS_HEADER = """
    real = os.pwritev

    def pwritev(fd, buffers, offset, *rest):  # a slot's header blanked: one buffer
        if len(buffers) == 1 and "slots-" in os.readlink(f"/proc/self/fd/{fd}"):
            os._exit(9)  # kill -9 after the index entry and its log record, before the header
        return real(fd, buffers, offset, *rest)

    store = KVStore(SMALL, cfg)
    os.pwritev = pwritev
    wrong = make_kv(tokens)
    wrong[:, :, CHUNK:] += 1  # the second chunk's KV is found wrong: removed
    store.verify_against(tokens, wrong)
"""


def _verify(root) -> dict:
    code, out = cli("verify", root, "--json")
    (writer,) = json.loads(out[out.index("{"):])["namespaces"][0]["writers"]
    return {"code": code, **writer}


def _repair_and_reopen(root, cfg) -> int:
    """``verify --repair``, a clean verify after it, and the tokens a restart then loads."""
    assert cli("verify", root, "--repair")[0] == 0
    assert cli("verify", root)[0] == 0
    with KVStore(SMALL, cfg) as store:
        return exact(store, seq(0, 2))


def test_repair_finishes_a_removal_killed_before_the_slot_header_was_blanked(tmp_path):
    cfg = config(tmp_path, disk_chunks=2)
    assert _child(tmp_path, _STORED + _REMOVE_SECOND_KILLED_BEFORE_ITS_HEADER) == KILLED
    with KVStore(SMALL, cfg) as store:  # a restart does not take the chunk back
        assert exact(store, seq(0, 2)) == CHUNK
    found = _verify(tmp_path)
    assert _repair_and_reopen(tmp_path, cfg) == CHUNK  # the wrong chunk never comes back
    assert found["code"] == 1 and found["unindexed"] == [] and len(found.get("removed", [])) == 1


def test_a_write_into_the_slot_of_a_removal_cut_short_keeps_its_tombstone(tmp_path):
    """The removal killed as above; after a restart (the slot free) a write into that slot
    killed after it blanked the slot's entry and before the slot was written: the entry
    is still the tombstone, and a repair still finishes the removal."""
    cfg = config(tmp_path, disk_chunks=2)
    assert _child(tmp_path, _STORED + _REMOVE_SECOND_KILLED_BEFORE_ITS_HEADER) == KILLED
    assert _child(tmp_path, """
        from kvtier.disk import writes
        writes.write_fully = lambda *args: os._exit(9)  # kill -9 before the slot's bytes
        with KVStore(SMALL, cfg) as store:
            store.put(seq(1000, 1), make_kv(seq(1000, 1)))  # the free slot: the removed one's
            store.flush()
    """) == KILLED
    found = _verify(tmp_path)
    assert _repair_and_reopen(tmp_path, cfg) == CHUNK
    assert found["unindexed"] == [] and len(found.get("removed", [])) == 1, found


def _tombstoned_segment(tmp_path):
    """A segment of two chunks whose second slot's entry is its tombstone (the index file)."""
    assert _child(tmp_path, _STORED + _REMOVE_SECOND_KILLED_BEFORE_ITS_HEADER) == KILLED
    segment = segment_dir(tmp_path)
    return segment, segment / "index.kvt"


def test_every_reader_takes_a_tombstone_for_a_blank_entry(tmp_path):
    from kvtier.io.format import REMOVED

    segment, index = _tombstoned_segment(tmp_path)
    data = index.read_bytes()
    entries = [data[i:i + INDEX_ENTRY_BYTES] for i in range(0, len(data), INDEX_ENTRY_BYTES)]
    tombstones = [e for e in entries if e.startswith(REMOVED)]
    assert len(tombstones) == 1 and is_blank(tombstones[0])
    namespace = bytes.fromhex(segment.parent.parent.name)
    raw = json.loads((segment.parent.parent / "namespace.json").read_text())["raw_bytes"]
    found, bad = parse_index(data, namespace, SlotLayout(raw, 1, 64 * (raw + 4096)), 0)
    assert len(found) == 1 and bad == 0  # what a start-up adopts
    with SafeDir.open(segment) as directory:
        assert len(list(written_index_entries(directory, 64))) == 1  # the tools, the scheduler
        follower = LogFollower(directory, namespace, raw)  # another engine following the log
        try:
            follower.refresh()
            assert len(follower.slots) == 1 and follower.bad == 0
        finally:
            follower.close()


def test_mark_removed_makes_entries_tombstones_and_zeroes_junk():
    from kvtier.io.format import REMOVED, mark_removed

    rows = np.zeros((3, INDEX_ENTRY_BYTES), np.uint8)
    rows[0, :8] = np.frombuffer(b"KVTSLOT\x00", np.uint8)
    rows[0, 8:] = 7
    rows[1, :] = 5  # junk: no entry
    rows[2, :8] = np.frombuffer(REMOVED, np.uint8)
    before = rows.copy()
    mark_removed(rows)
    assert rows[0, :8].tobytes() == REMOVED and (rows[0, 8:] == before[0, 8:]).all()
    assert not rows[1].any() and (rows[2] == before[2]).all()
