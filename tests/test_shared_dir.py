"""Many stores on one directory: each writes its own segment, every one reads the others'
chunks, and a reader racing a writer gets a miss, never a wrong byte."""


import pytest

from kvtier import KVStore
from kvtier.tiers.base import TierName
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.shared import shared, wait_for
from tests.helpers.store import STRIDE, config, exact, load, seq

HOST, DISK, SHARED = TierName.HOST, TierName.DISK, TierName.SHARED


def test_a_store_reads_what_another_store_on_the_directory_wrote(tmp_path):
    tokens = seq(0, 4)
    with KVStore(SMALL, shared(tmp_path, "a")) as a, KVStore(SMALL, shared(tmp_path, "b")) as b:
        a.put(tokens, make_kv(tokens))
        a.flush()
        wait_for(lambda: b.lookup(tokens).tokens == 4 * CHUNK)
        assert b.lookup(tokens).chunks_by_tier == {SHARED: 4}
        assert exact(b, tokens) == 4 * CHUNK
        stats = b.stats()
        assert stats.shared_reads == 4 and stats.chunks_loaded == {SHARED: 4}
        assert stats.shared_writers == 1 and stats.disk_writes == 0
        assert b.lookup(tokens).chunks_by_tier[HOST] >= 1  # now in b's own host memory
        (writer,) = b.writers()
        assert writer.writer == "a" and writer.live and writer.chunks == 4
        assert writer.lease is not None and writer.lease.instance == "a"
        assert b.flush() and b.stats().disk_writes == 0  # a's copy is on disk: not written again


def test_chunks_read_from_another_writer_are_never_copied_into_the_readers_segment(tmp_path):
    theirs, mine = seq(0, 4), seq(100_000, 8)
    with KVStore(SMALL, shared(tmp_path, "a")) as a, KVStore(SMALL, shared(tmp_path, "b")) as b:
        a.put(theirs, make_kv(theirs))
        a.flush()
        wait_for(lambda: b.lookup(theirs).tokens == 4 * CHUNK)
        assert exact(b, theirs) == 4 * CHUNK  # into b's host memory (4 chunks)
        b.put(mine, make_kv(mine))  # evicts them from host memory: dropped, not written
        assert b.flush()
        assert b.stats().disk_writes == 8
        assert b.lookup(theirs).chunks_by_tier == {SHARED: 4}
        assert exact(b, theirs) == 4 * CHUNK


def test_files_of_a_segment_deleted_since_are_closed_so_their_space_goes_back(tmp_path):
    tokens = seq(0, 2)
    with KVStore(SMALL, shared(tmp_path, "a")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
    with KVStore(SMALL, shared(tmp_path, "b")) as b:
        assert exact(b, tokens) == 2 * CHUNK  # a's slot file is now open in b
        (slots,) = tmp_path.glob("*/writers/a/slots-0000.kvt")
        slots.unlink()  # as a reclaim does
        wait_for(lambda: not deleted_files_open())  # b's next refresh closes it
        b.flush()


def deleted_files_open() -> list[str]:
    import os

    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith("slots-0000.kvt (deleted)"):
            found.append(target)
    return found


def test_a_new_store_sees_what_is_there_at_once(tmp_path):
    tokens = seq(0, 3)
    with KVStore(SMALL, shared(tmp_path, "a")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
        with KVStore(SMALL, shared(tmp_path, "b", share_refresh="1h")) as b:
            assert exact(b, tokens) == 3 * CHUNK  # its first refresh ran when it opened


def test_with_share_refresh_off_other_writers_are_not_looked_at(tmp_path):
    tokens = seq(0, 2)
    with KVStore(SMALL, shared(tmp_path, "a")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
        with KVStore(SMALL, shared(tmp_path, "b", share_refresh="off")) as b:
            assert b.lookup(tokens).tokens == 0 and b.writers() == []


def test_a_chunk_overwritten_after_the_last_refresh_is_a_miss_never_wrong_bytes(tmp_path):
    first, later = seq(0, 4), [seq(10_000 * i, 4) for i in range(1, 5)]
    with KVStore(SMALL, shared(tmp_path, "a", disk_chunks=16)) as a:  # 4 chunks: a quarter
        a.put(first, make_kv(first))
        a.flush()
        with KVStore(SMALL, shared(tmp_path, "b", share_refresh="1h")) as b:
            assert b.lookup(first).chunks_by_tier == {SHARED: 4}  # seen once, never again
            for prefix in later:  # a's disk holds 4 chunks: each of first's slots is reused
                a.put(prefix, make_kv(prefix))
                a.flush()
            n, _ = load(b, first)
            assert n == 0 and b.stats().shared_failures >= 1
            assert b.lookup(first).tokens == 0  # the copy that failed is forgotten
        assert exact(a, later[-1]) == 4 * CHUNK  # a's own files were never touched by b


def test_a_writer_that_restarts_is_followed_again(tmp_path):
    tokens, more = seq(0, 2), seq(50_000, 2)
    with KVStore(SMALL, shared(tmp_path, "b")) as b:
        with KVStore(SMALL, shared(tmp_path, "a")) as a:
            a.put(tokens, make_kv(tokens))
            a.flush()
        wait_for(lambda: b.lookup(tokens).tokens == 2 * CHUNK)
        with KVStore(SMALL, shared(tmp_path, "a")) as a:  # a new log: b starts over from it
            a.put(more, make_kv(more))
            a.flush()
            wait_for(lambda: b.lookup(more).tokens == 2 * CHUNK)
            assert exact(b, tokens) == 2 * CHUNK and exact(b, more) == 2 * CHUNK


@pytest.mark.parametrize("junk", ["file", "symlink", "bad name"])
def test_entries_in_writers_that_are_not_segments_are_passed_over(tmp_path, junk):
    tokens = seq(0, 2)
    with KVStore(SMALL, shared(tmp_path, "a")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
    (writers,) = tmp_path.glob("*/writers")
    if junk == "file":
        (writers / "c").write_bytes(b"x")
    elif junk == "symlink":
        (writers / "c").symlink_to(writers / "a")
    else:
        (writers / ".hidden").mkdir(mode=0o700)
    with KVStore(SMALL, shared(tmp_path, "b")) as b:
        assert [w.writer for w in b.writers()] == ["a"]
        assert exact(b, tokens) == 2 * CHUNK


def test_a_writer_beyond_share_writers_reads_the_others_but_writes_nothing(tmp_path):
    tokens, mine = seq(0, 2), seq(70_000, 2)
    with KVStore(SMALL, shared(tmp_path, "a", share_writers=1)) as a, \
            KVStore(SMALL, shared(tmp_path, "b", share_writers=1)) as b:
        a.put(tokens, make_kv(tokens))
        a.flush()
        (reason,) = b.stats().paths_down.values()
        assert "1 writer seats of" in reason and "held (by a) and share_writers is 1" in reason
        wait_for(lambda: b.lookup(tokens).tokens == 2 * CHUNK)
        assert exact(b, tokens) == 2 * CHUNK
        b.put(mine, make_kv(mine))
        assert not b.flush() and b.stats().disk_writes == 0
    assert [p.parent.name for p in tmp_path.glob("*/writers/*/lease")] == ["a"]


def test_with_default_writer_ids_a_writer_without_a_seat_reads_the_others(tmp_path):
    tokens = seq(0, 2)
    plain = config(tmp_path, share_refresh="50ms", share_writers=1)  # no instance_id
    with KVStore(SMALL, plain) as a, KVStore(SMALL, plain) as b:
        a.put(tokens, make_kv(tokens))
        a.flush()
        (reason,) = b.stats().paths_down.values()
        assert "held (by" in reason and "share_writers is 1" in reason
        assert b.disk.writer != a.disk.writer  # the segment a holds is not b's own
        wait_for(lambda: b.lookup(tokens).tokens == 2 * CHUNK)
        assert exact(b, tokens) == 2 * CHUNK and b.stats().shared_reads == 2


def test_a_path_failing_for_another_reason_never_makes_a_busy_id_its_own(tmp_path):
    tokens = seq(0, 2)
    roots = [tmp_path / "p0", tmp_path / "p1"]  # p1 missing, for every store
    roots[0].mkdir(mode=0o700)
    plain = {**config(roots[0], share_refresh="50ms", share_writers=1),
             "disk_paths": [str(r) for r in roots]}
    with KVStore(SMALL, plain) as a, KVStore(SMALL, plain) as b:
        a.put(tokens, make_kv(tokens))
        a.flush()
        assert b.disk.writer != a.disk.writer
        wait_for(lambda: b.lookup(tokens).tokens == 2 * CHUNK)
        assert exact(b, tokens) == 2 * CHUNK


def test_writers_without_a_seat_look_for_an_id_again_when_one_is_given_back(tmp_path):
    """Two stores without a seat stopped at the same id; once the only seat is given back,
    the one that takes it may take another id, and the other still reads it."""
    tokens = seq(0, 2)
    quick = config(tmp_path, share_refresh="50ms", share_writers=1, lease_timeout="2s",
                   disk_retry="0.2s")
    a = KVStore(SMALL, quick)
    b, c = KVStore(SMALL, quick), KVStore(SMALL, quick)
    try:
        assert b.stats().paths_down and c.stats().paths_down
        assert b.disk.writer == c.disk.writer != a.disk.writer
        a.close()
        tries = iter(range(10**6))

        def written() -> bool:  # a path is tried again as the store is used
            i = next(tries)
            for store, at in ((b, 90_000), (c, 91_000)):
                store.put(seq(at + i, 1), make_kv(seq(at + i, 1)))
            return bool(b.flush()) or bool(c.flush())

        wait_for(written, timeout=20)
        winner, loser = (b, c) if not b.stats().paths_down else (c, b)
        assert loser.stats().paths_down and winner.disk.writer != loser.disk.writer
        winner.put(tokens, make_kv(tokens))
        winner.flush()
        wait_for(lambda: loser.lookup(tokens).tokens == 2 * CHUNK)
        assert exact(loser, tokens) == 2 * CHUNK
        # the winner's view follows its new id: its own segment is not another writer's
        wait_for(lambda: [w.writer for w in winner._state.others.writers()] == [loser.disk.writer]
                 or not winner._state.others.writers())
    finally:
        for store in (a, b, c):
            store.close()


def test_each_writer_fills_at_most_its_share_of_disk_capacity(tmp_path):
    prefixes = [seq(10_000 * i, 4) for i in range(6)]
    with KVStore(SMALL, shared(tmp_path, "a", disk_chunks=16)) as a:  # 4 writers: 4 chunks
        for prefix in prefixes:
            a.put(prefix, make_kv(prefix))
            a.flush()
        assert a.disk.num_slots == 4
    files = list(tmp_path.glob("*/writers/a/slots-*.kvt"))
    assert sum(f.stat().st_size for f in files) <= 4 * STRIDE


def test_a_restarted_writer_takes_its_own_seat_back(tmp_path):
    tokens = seq(0, 2)
    with KVStore(SMALL, shared(tmp_path, "a", share_writers=1)) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
    with KVStore(SMALL, shared(tmp_path, "a", share_writers=1)) as a:
        assert not a.stats().paths_down and a.stats().recovered_chunks == 2
    assert [p.read_text() for p in tmp_path.glob("*/seats/seat-*")] == ["a"]


def test_the_segment_of_a_writer_that_is_gone_is_reclaimed_and_its_seat_handed_on(tmp_path):
    tokens, mine = seq(0, 2), seq(70_000, 2)
    quick = {"share_writers": 1, "lease_timeout": "2s", "disk_retry": "0.2s"}
    a = KVStore(SMALL, shared(tmp_path, "a", **quick))
    a.put(tokens, make_kv(tokens))
    a.flush()
    with KVStore(SMALL, shared(tmp_path, "b", **quick)) as b:
        assert b.stats().paths_down  # no seat while a holds the only one
        a.close()  # gone: no more heartbeats, its lock let go
        assert exact(b, tokens) == 2 * CHUNK  # read until it is reclaimed
        wait_for(lambda: not list(tmp_path.glob("*/writers/a")), timeout=15)
        assert b.lookup(tokens).chunks_by_tier.get(SHARED, 0) == 0
        # a's seat given back: free, or b's already (its path is retried every 0.2 s)
        assert [p.read_text() for p in tmp_path.glob("*/seats/seat-*")] in ([], ["b"])
        b.put(mine, make_kv(mine))
        wait_for(lambda: bool(b.flush()), timeout=15)  # its path came back, with a's seat
        assert not b.stats().paths_down and b.stats().disk_writes >= 2
        assert [p.read_text() for p in tmp_path.glob("*/seats/seat-*")] == ["b"]


def test_a_writer_whose_lock_is_held_on_this_host_is_never_reclaimed(tmp_path, monkeypatch):
    from kvtier.segment import lease
    from kvtier.shared.view import SharedView

    tokens = seq(0, 2)
    monkeypatch.setattr(lease.Lease, "beat", lambda self, closing=False: None)  # heartbeats stop, a lives on
    now = [0.0]  # the reader's clock, moved by hand
    with KVStore(SMALL, shared(tmp_path, "a", lease_timeout="2s")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
        view = SharedView([str(tmp_path)], a.namespace, a.chunk_bytes, ("b",), 2.0,
                          clock=lambda: now[0])
        view.refresh()
        now[0] += 2.1  # its lease stood still for lease_timeout
        for _ in range(3):
            view.refresh()
        assert [w.live for w in view.writers()] == [False] and view.reclaimed == 0
        assert list(tmp_path.glob("*/writers/a")) and len(view) == 2
        view.close()


def test_a_reader_with_a_shorter_lease_timeout_waits_for_the_writers_own(tmp_path, monkeypatch):
    from kvtier.shared import upkeep
    from kvtier.shared.view import SharedView

    tokens = seq(0, 2)
    monkeypatch.setattr(upkeep, "held_here", lambda directory: False)  # as if elsewhere
    now = [0.0]  # the reader's clock, moved by hand
    with KVStore(SMALL, shared(tmp_path, "a", lease_timeout="300s")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
        view = SharedView([str(tmp_path)], a.namespace, a.chunk_bytes, ("b",), 2.0,
                          clock=lambda: now[0])
        view.refresh()
        now[0] += 3.5  # past the reader's timeout, within a's first heartbeat (every 50 s)
        view.refresh()
        assert [w.live for w in view.writers()] == [True] and list(tmp_path.glob("*/writers/a"))
        assert len(view) == 2 and a.lookup(tokens).chunks_by_tier[HOST] == 2
        now[0] += 300  # past the writer's own timeout, its lease standing still: gone
        view.refresh()  # (let go of to be reclaimed, which a's lock held here refuses)
        assert not any(w.live for w in view.writers())
        view.close()


def test_reclaiming_leaves_a_segment_made_again_or_locked(tmp_path):
    import fcntl
    import os

    from kvtier.io.safefs import SafeDir
    from kvtier.segment.seats import reclaim_segment

    tokens = seq(0, 2)
    with KVStore(SMALL, shared(tmp_path, "a")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
    (segment,) = tmp_path.glob("*/writers/a")
    watched = segment.stat().st_ino
    with SafeDir.open(segment.parents[1]) as ns_dir:
        assert not reclaim_segment(ns_dir, "a", watched + 1)  # not the directory watched
        lock = os.open(segment / "lock", os.O_RDWR)
        fcntl.flock(lock, fcntl.LOCK_EX)  # a writer of this host holds it
        assert not reclaim_segment(ns_dir, "a", watched)
        os.close(lock)
        assert list(segment.glob("slots-*.kvt")) and (segment / "lease").exists()
        assert reclaim_segment(ns_dir, "a", watched) and not segment.exists()
        assert not list(segment.parents[1].glob("seats/seat-*"))


@pytest.mark.parametrize("by", ["reclaim", "gc --gone"])
def test_a_segment_left_with_an_entry_kvtier_did_not_write_keeps_its_seat(tmp_path, by):
    """Both removers leave the entry, the directory and the seat: a reclaim gave the seat
    back although the directory stayed (and said the segment was not proven free)."""
    import time

    from kvtier.io.safefs import SafeDir
    from kvtier.ops.cache import namespaces
    from kvtier.ops.reclaim import gc
    from kvtier.segment.seats import reclaim_segment

    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    with KVStore(SMALL, shared(root, "a")) as a:
        a.put(seq(0, 2), make_kv(seq(0, 2)))
        assert a.flush()
    (segment,) = root.glob("*/writers/a")
    (segment / "notes.txt").write_text("not kvtier's")
    if by == "reclaim":
        with SafeDir.open(segment.parents[1]) as ns_dir:
            assert not reclaim_segment(ns_dir, "a", segment.stat().st_ino)
    else:
        time.sleep(1.1)  # gone for a second
        assert not gc(namespaces(root), gone_s=1.0).segments_removed
    assert [p.name for p in segment.iterdir()] == ["notes.txt"]
    assert [p.read_text() for p in segment.parents[1].glob("seats/seat-*")] == ["a"]


def test_junk_in_writers_never_hides_the_real_writers(tmp_path):
    tokens = seq(0, 2)
    with KVStore(SMALL, shared(tmp_path, "a")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
    (writers,) = tmp_path.glob("*/writers")
    for i in range(4100):  # more than MAX_WRITERS, named like writers, sorting before "a"
        (writers / f"0junk{i:05d}").write_bytes(b"")
    with KVStore(SMALL, shared(tmp_path, "b", share_refresh="1h")) as b:  # refreshed as it opens
        assert [w.writer for w in b.writers()] == ["a"]
        assert exact(b, tokens) == 2 * CHUNK


def test_a_writer_whose_segment_is_reclaimed_as_it_opens_never_writes_without_a_seat(
        tmp_path, monkeypatch):
    """A writer restarting under its old id finds its seat just as another process reclaims
    its segment (a writer gone) and gives that seat back: it must not go on with a segment of
    no seat, which would let a third writer take the seat (two segments, one seat)."""
    import kvtier.segment.segment_open as segment_open
    from kvtier.segment.seats import claim_seat, reclaim_segment

    root = tmp_path / "cache"
    root.mkdir(mode=0o700)

    def cfg(name: str) -> dict:
        return config(root, instance_id=name, share_writers=1, share_refresh="off")

    with KVStore(SMALL, cfg("a")) as first:
        first.put(seq(0, 1), make_kv(seq(0, 1)))
        assert first.flush()
    (ns,) = list(root.iterdir())
    gone = (ns / "writers" / "a").stat().st_ino

    def claim_then_reclaimed(ns_dir, writer, limit):
        seat = claim_seat(ns_dir, writer, limit)
        if writer == "a":  # the reclaimer runs between the claim and the segment's lock
            assert reclaim_segment(ns_dir, "a", gone)
        return seat

    monkeypatch.setattr(segment_open, "claim_seat", claim_then_reclaimed)
    restarted = KVStore(SMALL, cfg("a"))
    monkeypatch.setattr(segment_open, "claim_seat", claim_seat)
    third = KVStore(SMALL, cfg("c"))
    try:
        up = [s for s in (restarted, third) if not s.stats().paths_down]
        assert len(up) == 1  # one seat: one writer on the path
        for store in (restarted, third):
            store.put(seq(100, 2), make_kv(seq(100, 2)))
            store.flush()
        assert restarted.stats().disk_writes + third.stats().disk_writes == 2
    finally:
        restarted.close()
        third.close()


def test_a_reclaim_gives_the_seat_back_before_the_segment_directory_goes(tmp_path, monkeypatch):
    """A writer coming back under the same id between the two finds no old seat of its own
    to lose: it claims one afresh (or is refused), never writing on with a seat that a late
    release then takes away."""
    from kvtier.io.safefs import SafeDir
    from kvtier.segment.seats import reclaim_segment

    with KVStore(SMALL, shared(tmp_path, "a")) as a:
        a.put(seq(0, 2), make_kv(seq(0, 2)))
        a.flush()
    (segment,) = tmp_path.glob("*/writers/a")
    seats = segment.parents[1] / "seats"
    seen: list[list[str]] = []
    plain_remove_dir = SafeDir.remove_dir

    def remove_dir(self, name):
        seen.append(sorted(p.read_text() for p in seats.glob("seat-*")))
        return plain_remove_dir(self, name)

    monkeypatch.setattr(SafeDir, "remove_dir", remove_dir)
    with SafeDir.open(segment.parents[1]) as ns_dir:
        assert reclaim_segment(ns_dir, "a", segment.stat().st_ino)
    assert seen == [[]]  # the seat was gone when the directory went


def test_a_writer_whose_seat_is_taken_away_stops_writing_at_its_next_beat(tmp_path):
    with KVStore(SMALL, shared(tmp_path, "a", share_writers=1, lease_timeout="2s")) as a:
        a.put(seq(0, 1), make_kv(seq(0, 1)))
        assert a.flush() and not a.stats().paths_down
        (seat,) = tmp_path.glob("*/seats/seat-*")
        seat.unlink()  # given back by another process (a reclaim or orphan race)
        wait_for(lambda: a.stats().paths_down)
        assert "holds no seat" in next(iter(a.stats().paths_down.values()))


def seats_out_of_files(monkeypatch) -> None:
    """From now on every seat file fails to open as in a process short of open files."""
    import errno

    from kvtier.io.safefs import SafeDir
    from kvtier.segment.names import seat_number

    plain_open = SafeDir.open_file

    def open_file(self, name, flags, *, create=False):
        if seat_number(name) is not None:
            raise OSError(errno.EMFILE, "Too many open files")
        return plain_open(self, name, flags, create=create)

    monkeypatch.setattr(SafeDir, "open_file", open_file)


def test_a_writer_that_cannot_read_its_seat_at_a_beat_keeps_its_path_and_chunks(
        tmp_path, monkeypatch):
    """Who holds the seat cannot be told then: the beat goes on, rather than taking the path
    out of service as if the seat were given back (it came back with its disk tier empty)."""
    tokens = seq(0, 8)
    with KVStore(SMALL, shared(tmp_path, "a", share_writers=2, share_refresh="off",
                               lease_timeout="1h")) as a:  # no beat of its own meanwhile
        a.put(tokens, make_kv(tokens))
        assert a.flush()
        seats_out_of_files(monkeypatch)
        a.disk.paths[0].dir.lease.beat()
        monkeypatch.undo()
        a.disk.paths[0].dir.lease.beat()
        assert a.stats().paths_down == {}
        assert a.lookup(tokens).tokens == 8 * CHUNK


def test_seats_that_cannot_be_read_are_neither_taken_twice_nor_judged_orphans(
        tmp_path, monkeypatch):
    """A writer whose own seat cannot be read for a moment fails its try, rather than taking
    a second seat it would never give back; a reader does not judge the seat an orphan."""
    from kvtier.io.safefs import SafeDir
    from kvtier.segment.seat_orphans import orphan_seats
    from kvtier.segment.seats import claim_seat

    ns = tmp_path / "ns"
    ns.mkdir(mode=0o700)
    with SafeDir.open(ns) as ns_dir:
        assert claim_seat(ns_dir, "a", 2) == 0
        (ns / "writers" / "a").mkdir(parents=True)
        seats_out_of_files(monkeypatch)
        with pytest.raises(OSError, match="Too many open files"):
            claim_seat(ns_dir, "a", 2)
        assert orphan_seats(ns_dir, None) == []
    assert sorted(p.name for p in (ns / "seats").iterdir()) == ["seat-0000"]


def test_a_writer_that_finds_its_own_seat_again_marks_it_in_use(tmp_path):
    """A reader judging seats as orphans frees one only if it is unchanged since: a writer
    taking its seat again touches it, so a stale judgement frees nothing."""
    import os

    from kvtier.io.safefs import SafeDir
    from kvtier.segment.seat_orphans import free_orphan_seats, orphan_seats
    from kvtier.segment.seats import claim_seat

    ns = tmp_path / "ns"
    ns.mkdir(mode=0o700)
    with SafeDir.open(ns) as ns_dir:
        assert claim_seat(ns_dir, "a", 1) == 0  # and no segment made: an orphan
        (seat,) = ns.glob("seats/seat-*")
        os.utime(seat, ns=(0, 0))
        judged = orphan_seats(ns_dir, 1.0)
        assert [name for name, _ in judged] == [seat.name]
        assert claim_seat(ns_dir, "a", 1) == 0  # the writer comes back, before the free
        assert free_orphan_seats(ns_dir, 1.0) == []  # no longer old: nothing to free
        assert seat.exists()


def test_under_a_low_open_file_limit_a_reader_follows_fewer_writers_and_says_so(
        tmp_path, monkeypatch, caplog):
    import resource

    import kvtier.shared.followed as shared_view

    for name in ("a", "b", "c"):
        with KVStore(SMALL, shared(tmp_path, name)) as writer:
            writer.put(seq(ord(name) * 1000, 1), make_kv(seq(ord(name) * 1000, 1)))
            writer.flush()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    monkeypatch.setattr(shared_view.resource, "getrlimit", lambda which: (16, hard))
    assert shared_view.followable_writers(1) == 2  # a quarter of 16 files, two a writer
    with KVStore(SMALL, shared(tmp_path, "d")) as reader:
        assert reader._state.others.views[0].max_writers == 2
        assert [w.writer for w in reader.writers()] == ["a", "b"]  # not c: not followed
        assert "following only 2 other writers" in caplog.text
        assert reader.lookup(seq(ord("a") * 1000, 1)).tokens == CHUNK


def test_a_reader_out_of_open_files_keeps_its_view_rather_than_forgetting_every_writer(
        tmp_path, monkeypatch):
    import errno

    from kvtier.io.safefs import SafeDir

    tokens = seq(0, 2)
    with KVStore(SMALL, shared(tmp_path, "a")) as a:
        a.put(tokens, make_kv(tokens))
        a.flush()
    with KVStore(SMALL, shared(tmp_path, "b", share_refresh="1h")) as b:
        assert b.lookup(tokens).chunks_by_tier == {SHARED: 2}

        def out_of_files(self, limit):
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(SafeDir, "scan", out_of_files)
        b._state.others.views[0].refresh()
        assert b.lookup(tokens).chunks_by_tier == {SHARED: 2}
        assert exact(b, tokens) == 2 * CHUNK
