"""A store reads the shared directory under a writer id of its own only on the paths where it
holds that segment (its lock and seat): a store left without a segment follows every writer
there, so a segment another process opens later under the id where its search for one
stopped is another writer's, whose chunks it reads, never its own, skipped."""

import time

from kvtier import KVStore
from kvtier.io.safefs import SafeDir
from kvtier.segment.names import WRITERS_DIR, writer_ids
from kvtier.segment.seats import reclaim_segment
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.store import config, exact, seq


def reclaim(root, namespace_id: str, writer: str) -> None:
    """The segment of ``writer`` (stopped) and its seat given back, as a reclaim does."""
    with SafeDir.open(root) as top, top.subdir(namespace_id) as ns_dir:
        with ns_dir.subdir(WRITERS_DIR) as writers, writers.subdir(writer) as segment:
            inode = segment.inode()
        assert reclaim_segment(ns_dir, writer, inode)


def test_a_store_without_a_seat_reads_a_segment_opened_later_under_the_id_it_stopped_at(tmp_path):
    """share_writers 1: ``a`` holds the seat, ``b`` (default ids) finds it held and stops at
    the first default id. ``a`` stops and its seat is given back; ``c`` then opens the
    first default id before ``b`` tries its path again (not for an hour): ``b`` reads
    ``c``'s chunks."""
    tokens = seq(0, 2)
    one = config(tmp_path, share_writers=1, share_refresh="1h", disk_retry="1h")
    a = KVStore(SMALL, {**one, "instance_id": "a"})
    b = KVStore(SMALL, one)
    c = None
    try:
        assert b.stats().paths_down
        a.close()
        reclaim(tmp_path, b.namespace.id, "a")
        c = KVStore(SMALL, one)
        first = writer_ids(None)[0]
        assert not c.stats().paths_down and c.disk.writer == first == b.disk.writer
        c.put(tokens, make_kv(tokens))
        assert c.flush()
        b._state.others.refresh()
        assert [w.writer for w in b.writers()] == [first]
        assert b.lookup(tokens).tokens == 2 * CHUNK and exact(b, tokens) == 2 * CHUNK
        assert b.stats().paths_down and b.disk.paths.own == (None,)  # tried in an hour
    finally:
        for store in (a, b, c):
            if store is not None:
                store.close()


def test_a_path_where_a_store_holds_no_segment_is_read_under_no_id_of_its_own(tmp_path):
    """``b`` holds its segment on its first path and none on its second (no seat free there):
    a store given ``b``'s id opens that id on the second path (its first is ``b``'s), and
    ``b`` reads its chunks there, while its own segment on the first path stays its own."""
    roots = [tmp_path / "p0", tmp_path / "p1"]
    for root in roots:
        root.mkdir(mode=0o700)
    both = {**config(roots[0], share_writers=1, share_refresh="1h", disk_retry="1h"),
            "disk_paths": [str(r) for r in roots]}
    tokens = seq(0, 4)
    held = KVStore(SMALL, {**both, "instance_id": "a"})  # both seats: "a"
    held.close()
    reclaim(roots[0], held.namespace.id, "a")  # the first path's seat is free, not the second's
    b = KVStore(SMALL, both)
    c = None
    try:
        first = writer_ids(None)[0]
        assert list(b.stats().paths_down) == [str(roots[1])]
        reclaim(roots[1], b.namespace.id, "a")
        c = KVStore(SMALL, {**both, "instance_id": first})
        assert list(c.stats().paths_down) == [str(roots[0])]  # b holds it there
        c.put(tokens, make_kv(tokens))
        c.flush()
        written = c.stats().disk_writes
        assert written >= 1  # on the second path: the only one c writes
        b._state.others.refresh()
        assert [(w.writer, w.chunks) for w in b.writers()] == [(first, written)]
        assert b.disk.paths.own == (first, None)
    finally:
        for store in (b, c):
            if store is not None:
                store.close()


def test_a_flush_never_counts_a_chunk_of_its_own_segment_followed_while_its_path_came_back(
        tmp_path, monkeypatch):
    """A path taken out of service comes back: between its old directory's close and the
    reopen the store holds no segment there, and a refresh of the view in that moment
    follows the store's own segment as another writer's. Its chunks on disk were dropped
    with the path, its old slots now free: a flush still writes the chunks held in memory
    (before, it skipped them as "held by another writer" and said True; after a reopen they
    were gone)."""
    from kvtier.disk.path_opener import PathOpener

    cfg = config(tmp_path, host_chunks=8, disk_chunks=8, write_policy="write_through",
                 disk_retry="10ms", share_refresh="60s")
    store = KVStore(SMALL, cfg)
    others, real = store._state.others, PathOpener.open
    first, later = seq(0, 4), seq(500_000, 4)
    store.put(first, make_kv(first))
    assert store.flush(5)

    def refreshed_then_opened(self, root, busy, bounded=False):
        others.refresh()  # the view's refresh falls between the close and the reopen
        return real(self, root, busy, bounded)

    monkeypatch.setattr(PathOpener, "open", refreshed_then_opened)
    paths = store.disk.paths
    paths.take_down(paths[0], "taken out by the test")
    for _ in range(1000):
        if store.stats().paths_back:
            break
        store.lookup(first)  # retires its slots, then tries the path again
        time.sleep(0.01)
    assert store.stats().paths_back
    monkeypatch.setattr(PathOpener, "open", real)
    store.put(later, make_kv(later))  # written through into the old slots, now free
    assert store.flush(5)
    assert store.close()
    with KVStore(SMALL, cfg) as reopened:
        assert exact(reopened, first) == 4 * CHUNK and exact(reopened, later) == 4 * CHUNK
