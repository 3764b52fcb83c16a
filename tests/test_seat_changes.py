"""Restarts on one directory with the writers' seats changed under them: a lower
``share_writers``, a new ``instance_id``. ``disk_capacity`` stays a bound on the whole
directory, and a writer left without a seat by writers that are gone gets one back, in a
private cache too."""

import os
import time
from pathlib import Path

import pytest

from kvtier import KVStore
from kvtier.io.safefs import SafeDir
from kvtier.segment import seats as seats_module
from kvtier.segment.cachedir import CacheDirError
from kvtier.segment.seat_files import read_holder
from kvtier.segment.seats import claim_seat
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.seat_races import claims_meanwhile, started_together
from tests.helpers.store import STRIDE, config, exact, seq


def run(root, name, tokens, **extra) -> None:
    """A store ``name`` on ``root`` that puts and flushes ``tokens``, then stops."""
    with KVStore(SMALL, config(root, instance_id=name, share_refresh="off", **extra)) as store:
        store.put(tokens, make_kv(tokens))
        assert store.flush()


def seats_of(root: Path) -> dict[str, str | None]:
    (ns,) = [p for p in root.iterdir() if p.is_dir()]
    return seats_of_ns(ns)


def seats_of_ns(ns: Path) -> dict[str, str | None]:
    with SafeDir.open(ns / "seats") as seats:
        return {name: read_holder(seats, name) for name in seats.listed(64)}


def slot_file_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("*/writers/*/*") if p.name.startswith("slots"))


def test_a_lower_share_writers_counts_the_seats_of_writers_that_ran_with_more(tmp_path):
    """Two writers fill their quarters of the directory; one restarts with share_writers=1.
    It took its old seat and the whole disk_capacity, with the other's segment still there:
    the directory held 1.25x its bound. It now writes nothing until that segment is gone."""
    bound = {"disk_chunks": 8}
    run(tmp_path, "a", seq(0, 2), share_writers=4, **bound)
    run(tmp_path, "b", seq(1000, 2), share_writers=4, **bound)
    assert seats_of(tmp_path) == {"seat-0000": "a", "seat-0001": "b"}
    before = slot_file_bytes(tmp_path)
    tokens = seq(2000, 8)
    with KVStore(SMALL, config(tmp_path, instance_id="a", share_writers=1, share_refresh="off",
                               **bound)) as a:
        (reason,) = a.stats().paths_down.values()
        assert "held (by b) and share_writers is 1" in reason
        a.put(tokens, make_kv(tokens))
        assert not a.flush() and a.stats().disk_writes == 0
    assert seats_of(tmp_path) == {"seat-0000": "a", "seat-0001": "b"}
    assert slot_file_bytes(tmp_path) == before <= 8 * STRIDE


def gone(root, writers, seats) -> None:
    """``writers`` gone, their segments cleared and ``seats`` given back."""
    for name in writers:
        (segment,) = root.glob(f"*/writers/{name}")
        for f in segment.iterdir():
            f.unlink()
        segment.rmdir()
    for seat in seats:
        os.unlink(next(root.glob(f"*/seats/{seat}")))


def test_a_writer_seated_past_a_lower_share_writers_takes_a_seat_within_and_gives_back_its_own(
        tmp_path):
    run(tmp_path, "x", seq(0, 1), share_writers=4)
    run(tmp_path, "y", seq(1000, 1), share_writers=4)
    run(tmp_path, "c", seq(2000, 1), share_writers=4)
    assert seats_of(tmp_path)["seat-0002"] == "c"
    gone(tmp_path, ("x", "y"), ("seat-0000", "seat-0001"))
    tokens = seq(2000, 1)
    with KVStore(SMALL, config(tmp_path, instance_id="c", share_writers=2, share_refresh="off")) as c:
        assert c.stats().paths_down == {}
        assert exact(c, tokens) == CHUNK  # its own chunk, from its own segment
    assert seats_of(tmp_path) == {"seat-0000": "c"}


def test_a_writer_seated_past_a_lower_share_writers_moves_in_beside_another_writer(tmp_path):
    """Seats {0: x, 3: w}, share_writers lowered to 2: w counted its own old seat among those
    held, gave back the free seat it took as one too many, and ran without a disk tier for
    as long as x held its seat."""
    for name, first in (("x", 0), ("y", 1000), ("z", 2000), ("w", 3000)):
        run(tmp_path, name, seq(first, 1), share_writers=4)
    gone(tmp_path, ("y", "z"), ("seat-0001", "seat-0002"))
    assert seats_of(tmp_path) == {"seat-0000": "x", "seat-0003": "w"}
    with KVStore(SMALL, config(tmp_path, instance_id="w", share_writers=2, share_refresh="off")) as w:
        assert w.stats().paths_down == {}
        assert exact(w, seq(3000, 1)) == CHUNK  # its own chunk, from its own segment
    assert seats_of(tmp_path) == {"seat-0000": "x", "seat-0001": "w"}


def test_a_private_cache_whose_seat_a_gone_writer_holds_gets_it_back(tmp_path):
    """instance_id changed, share_writers=1, share_refresh off: the old segment held the only
    seat and nothing in a private cache ever reclaimed it; the store ran without a disk tier
    for good. Its path's tries now reclaim a holder watched gone for lease_timeout."""
    old = seq(0, 2)
    run(tmp_path, "old", old, share_writers=1)
    quick = {"share_writers": 1, "lease_timeout": "2s", "disk_retry": "200ms"}
    tokens = seq(1000, 2)
    with KVStore(SMALL, config(tmp_path, instance_id="renamed", share_refresh="off", **quick)) as store:
        assert store.stats().paths_down
        deadline = time.monotonic() + 20
        while store.stats().paths_down:
            assert time.monotonic() < deadline, "the gone writer's seat was never freed"
            store.put(tokens, make_kv(tokens))  # each call starts the tries that are due
            time.sleep(0.1)
        store.put(tokens, make_kv(tokens))
        assert store.flush() and store.stats().disk_writes >= 2
    assert seats_of(tmp_path) == {"seat-0000": "renamed"}
    assert [p.name for p in tmp_path.glob("*/writers/*")] == ["renamed"]


def test_a_writer_without_a_seat_reclaims_no_live_writer(tmp_path):
    quick = {"share_writers": 1, "lease_timeout": "2s", "disk_retry": "200ms", "share_refresh": "off"}
    tokens = seq(0, 2)
    with KVStore(SMALL, config(tmp_path, instance_id="a", **quick)) as a:
        a.put(tokens, make_kv(tokens))
        assert a.flush()
        with KVStore(SMALL, config(tmp_path, instance_id="b", **quick)) as b:
            deadline = time.monotonic() + 5  # more than two lease_timeouts of tries
            while time.monotonic() < deadline:
                b.put(seq(1000, 1), make_kv(seq(1000, 1)))
                time.sleep(0.1)
            assert b.stats().paths_down and a.stats().paths_down == {}
        assert exact(a, tokens) == 2 * CHUNK
    assert seats_of(tmp_path) == {"seat-0000": "a"}


def test_writers_claiming_at_once_never_hold_more_seats_than_share_writers(tmp_path):
    """Each counts the seats held, then takes one: two counting at once both saw room. The
    one whose seat is highest within share_writers gives it back."""
    ns = tmp_path / "ns"
    ns.mkdir()
    with SafeDir.open(ns) as directory:
        claim_seat(directory, "z", 8)
    os.rename(ns / "seats" / "seat-0000", ns / "seats" / "seat-0005")  # from share_writers=8
    (ns / "writers" / "z").mkdir(parents=True)
    # "a" counts 1 seat held of 2; "b", elsewhere, claims then
    with claims_meanwhile(ns, "b", 2), SafeDir.open(ns) as directory, pytest.raises(
            CacheDirError, match=r"2 writer seats of \S+ are held \(by b, z\) and share_writers is 2"):
        claim_seat(directory, "a", 2)  # as they are now, not as counted before b's claim
    assert seats_of_ns(ns) == {"seat-0000": "b", "seat-0005": "z"}


def test_one_id_claimed_twice_at_once_keeps_one_seat(tmp_path):
    """Two processes of one host trying the first default id on an empty directory: each
    counted no seat held, and each took one under that id. The later one gives its seat
    back, so that the one of the two left without the segment's lock, trying its next id,
    finds a seat free."""
    ns = tmp_path / "ns"
    ns.mkdir()
    with claims_meanwhile(ns, "w-0", 2) as raced, SafeDir.open(ns) as directory:
        assert claim_seat(directory, "w-0", 2) == 0
    assert raced and seats_of_ns(ns) == {"seat-0000": "w-0"}
    with SafeDir.open(ns) as directory:
        assert claim_seat(directory, "w-1", 2) == 1


def test_two_engines_of_a_host_starting_together_on_one_directory_each_write(tmp_path):
    """Default ids, share_writers 2: the second engine starts while the first is claiming
    its seat under the first id. The first then finds that segment locked and takes the
    next id, with the seat left free (it found both seats held under the first id, and
    its path out of service: test_processes, now and then)."""
    stores = started_together(
        lambda: KVStore(SMALL, config(tmp_path, share_writers=2, share_refresh="off")))
    try:
        assert [store.stats().paths_down for store in stores] == [{}, {}]
        writers = sorted(store.disk.writer for store in stores)
        assert sorted(seats_of(tmp_path).values()) == writers and writers[0] != writers[1]
        for i, store in enumerate(stores):
            tokens = seq(100 * i, 2)
            store.put(tokens, make_kv(tokens))
            assert store.flush() and store.stats().disk_writes == 2
    finally:
        for store in stores:
            store.close()


def test_a_default_id_another_process_of_this_host_writes_is_never_taken(tmp_path):
    """Default writer ids, share_writers lowered from 2 to 1 for a new engine next to a
    running one: the new one was refused a seat under the running engine's id before its
    lock was tried, kept that id, and skipped the running engine's chunks as its own."""
    tokens = seq(0, 2)
    with KVStore(SMALL, config(tmp_path, share_refresh="50ms", share_writers=2)) as a, \
            KVStore(SMALL, config(tmp_path, instance_id="q", share_refresh="50ms",
                                  share_writers=2)):
        a.put(tokens, make_kv(tokens))
        assert a.flush()
        with KVStore(SMALL, config(tmp_path, share_refresh="50ms", share_writers=1)) as b:
            assert b.disk.writer != a.disk.writer and b.stats().paths_down
            deadline = time.monotonic() + 10
            while b.lookup(tokens).tokens < 2 * CHUNK:
                assert time.monotonic() < deadline, "b never saw a's chunks"
                time.sleep(0.05)
            assert exact(b, tokens) == 2 * CHUNK


@pytest.mark.parametrize("by", ["reclaim", "gc --gone"])
def test_a_writer_coming_back_while_its_segment_is_removed_never_shares_a_seat(tmp_path,
                                                                             monkeypatch, by):
    """The seat is given back while the segment's lock file is still there and held: the
    writer coming back under its id finds the segment busy, rather than making a new lock
    file, finding its old seat and losing it to the release (two writers on one seat)."""
    from kvtier.ops import removal
    from kvtier.ops.cache import namespaces
    from kvtier.ops.reclaim import gc

    root = tmp_path / "cache"
    root.mkdir(mode=0o700)

    def cfg(name: str) -> dict:
        return config(root, instance_id=name, share_writers=1, share_refresh="off")

    run(root, "a", seq(0, 1), share_writers=1)
    time.sleep(1.1)  # gone for a second
    (ns,) = list(root.iterdir())
    module = seats_module if by == "reclaim" else removal
    real_release, back = module.release_seat, []

    def release_seat(ns_dir, writer):
        back.append(KVStore(SMALL, cfg("a")))  # "a" comes back at this moment
        real_release(ns_dir, writer)

    monkeypatch.setattr(module, "release_seat", release_seat)
    if by == "reclaim":
        with SafeDir.open(ns) as ns_dir:
            assert seats_module.reclaim_segment(ns_dir, "a", (ns / "writers" / "a").stat().st_ino)
    else:
        gc(namespaces(root), gone_s=1.0)
    monkeypatch.setattr(module, "release_seat", real_release)
    third = KVStore(SMALL, cfg("c"))
    try:
        assert back and back[0].stats().paths_down  # the segment was busy: not in service
        assert [s for s in (back[0], third) if not s.stats().paths_down] == [third]
    finally:
        back[0].close()
        third.close()
