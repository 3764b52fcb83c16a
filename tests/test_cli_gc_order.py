"""``kvtier gc`` frees a prompt's chunks tail first: each chunk's key is chained over the
chunks before it, so what gc keeps of a prompt must be its head, or it can never be hit.
Chunks go by write window (``kvtier.ops.victims``)."""

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kvtier import KVStore
from kvtier.disk import stamps
from kvtier.ops import reclaim
from kvtier.ops.cache import NamespaceDir, Segment, namespaces
from kvtier.ops.victims import WINDOW_S, SegmentChunks, free_order, victims
from tests.helpers.cli import as_json
from tests.helpers.fake_io import FakeEngine
from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, make_kv
from tests.helpers.store import config, load, seq


def written_ago(monkeypatch, seconds):
    """Chunks written from now on carry a time ``seconds`` ago, as if written then."""
    monkeypatch.setattr(stamps, "time", SimpleNamespace(
        time_ns=lambda: time.time_ns() - int(seconds * 1e9)))


def put(root, tokens, **extra):
    with KVStore(SMALL, config(root, **extra)) as store:
        store.put(tokens, make_kv(tokens))
        assert store.flush()


def served(root, tokens, **extra):
    """Tokens of ``tokens`` a store over ``root`` serves, and the chunks it found there."""
    with KVStore(SMALL, config(root, host_chunks=16, **extra)) as store:
        return load(store, tokens)[0], store.stats().recovered_chunks


def test_gc_target_keeps_a_prompts_head_which_still_hits(tmp_path):
    put(tmp_path, seq(0, 10))
    code, data = as_json("gc", tmp_path, "--target", 2 * CHUNK_BYTES)
    assert code == 0 and data["chunks_freed"] == 8
    assert served(tmp_path, seq(0, 10)) == (2 * CHUNK, 2)


def test_gc_keeps_the_head_of_a_prompt_whose_tail_reached_the_disk_first(tmp_path):
    """Each write is stamped when its slot is reserved, in the prompt's order, not when an
    I/O thread gets to it: here the job writing chunk 1 runs before the one writing 0."""
    make, engines = FakeEngine.factory()
    with KVStore(SMALL, config(tmp_path, host_chunks=16), io_engine=make) as store:
        engines[0].hold("disk0")
        store.put(seq(0, 6), make_kv(seq(0, 6)))  # write-through: two jobs take chunks 0 and 1
        engines[0].release_last_first("disk0", 2)
        assert store.flush()
    code, data = as_json("gc", tmp_path, "--target", CHUNK_BYTES)
    assert code == 0 and data["chunks_freed"] == 5
    assert served(tmp_path, seq(0, 6)) == (CHUNK, 1)


def test_gc_older_than_frees_the_rest_of_a_prompt_written_over_time(tmp_path, monkeypatch):
    written_ago(monkeypatch, 100)
    put(tmp_path, seq(0, 3))
    written_ago(monkeypatch, 90)  # the prompt's later chunks, written 10 s after its head
    put(tmp_path, seq(0, 6))
    written_ago(monkeypatch, 10)
    put(tmp_path, seq(5000, 2))
    monkeypatch.undo()
    code, data = as_json("gc", tmp_path, "--older-than", "95s")
    assert code == 0 and data["chunks_freed"] == 6  # the head, and the tail it leaves dead
    assert served(tmp_path, seq(5000, 2)) == (2 * CHUNK, 2)


def written(writer, *chunks):
    """``writer``'s segment holding ``chunks``, each ``(generation, seconds)``: written at
    ``seconds``, one byte stored, in slot ``generation``."""
    ns = NamespaceDir(Path("/cache"), "0" * 32, None)
    generations = np.array([generation for generation, _ in chunks], dtype=np.uint64)
    created = np.array([int(seconds * 1e9) for _, seconds in chunks], dtype=np.uint64)
    return SegmentChunks(Segment(ns, writer), generations.astype(np.int64), generations,
                         created, np.ones(len(chunks), dtype=np.int64))


def freed(groups, order) -> list[tuple[str, int]]:
    """(writer, generation) of each chunk of ``order`` (indexes over ``groups``)."""
    every = [(g.segment.writer, int(n)) for g in groups for n in g.generations]
    return [every[i] for i in order]


def test_windows_go_oldest_first_and_each_from_its_last_write():
    a = written("a", (4, WINDOW_S + 1), (1, 0), (3, 2), (2, 1))  # 4: past its window
    b = written("b", (8, 3), (7, 1))
    found = free_order([b, a])
    assert freed([b, a], found.chunks) == [("a", 3), ("a", 2), ("a", 1), ("b", 8), ("b", 7),
                                           ("a", 4)]
    assert found.window_sizes.tolist() == [3, 2, 1]
    chosen = victims([a, b], None, 4)
    assert [(g.segment.writer, g.generations[i].tolist()) for g, i in chosen] == [("a", [3, 2])]


def test_windows_that_start_together_go_by_writer():
    a, b = written("a", (1, 5)), written("b", (1, 5))
    assert freed([b, a], free_order([b, a]).chunks) == [("a", 1), ("b", 1)]


def test_older_than_takes_whole_windows_then_the_target_goes_on_from_the_next():
    old = time.time() - 1000
    a = written("a", (1, old), (2, old + 1), (3, old + 900), (4, old + 901))
    chosen = victims([a], 500, 1)  # the old window whole, then the last write of the next
    assert [g.generations[i].tolist() for g, i in chosen] == [[2, 1, 4]]
    assert victims([a], 2000, None) == [] and victims([], 1, 0) == []


def test_a_clock_set_back_starts_a_new_window():
    a = written("a", (1, 100), (2, 50))  # 2: written later, by a clock set back
    assert freed([a], free_order([a]).chunks) == [("a", 2), ("a", 1)]


def test_gc_frees_only_the_writes_it_chose(tmp_path, monkeypatch):
    """An engine that opens the segment after gc read it, evicts gc's victims (its oldest
    chunks) for new ones and stops, all before gc frees them: gc frees a slot only if its
    index entry still names the write it chose."""
    written_ago(monkeypatch, 100)
    put(tmp_path, seq(0, 6), disk_chunks=6)
    monkeypatch.undo()
    real = reclaim.victims

    def then_an_engine_runs(*args, **kwargs):
        chosen = real(*args, **kwargs)
        put(tmp_path, seq(9000, 6), disk_chunks=6)
        return chosen

    monkeypatch.setattr(reclaim, "victims", then_an_engine_runs)
    assert reclaim.gc(namespaces(tmp_path), older_than_s=50).chunks_freed == 0
    assert served(tmp_path, seq(9000, 6), disk_chunks=6) == (6 * CHUNK, 6)
