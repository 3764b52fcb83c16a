"""A directory of a cache root stuffed with entries (a hostile or broken co-writer) costs an
engine a bounded listing: its own segment and ``seats/`` are listed up to a bound, past
which the path is refused with a reason naming the directory, and ``writers/`` is never
listed to find this host's segments (each default id is looked up by name)."""

import errno
import os

import pytest

from kvtier import KVStore
from kvtier.connector.common.engine_writer import workers_writer
from kvtier.io.safefs import SafeDir, UnsafeEntry
from kvtier.segment import cachedir, seats, slot_files
from kvtier.segment.names import writer_ids
from kvtier.tiers.base import TierName
from tests.helpers.hostile import make_cache, namespace_of
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.store import config, exact, seq

BOUND = 24


def stuff(directory, count: int, prefix: str = "junk-") -> None:
    for i in range(count):
        (directory / f"{prefix}{i}").write_bytes(b"")


def test_a_listing_past_its_bound_stops_there_and_names_the_directory(tmp_path, monkeypatch):
    stuff(tmp_path, 10)
    listed = []
    real = os.scandir

    def counted(fd):
        entries = real(fd)
        return _Counting(entries, listed)

    monkeypatch.setattr(os, "scandir", counted)
    with SafeDir.open(tmp_path) as directory:
        assert directory.listed(10) == sorted(f"junk-{i}" for i in range(10))
        listed.clear()
        with pytest.raises(UnsafeEntry, match=f"{tmp_path} holds more than 4 entries") as info:
            directory.listed(4)
    assert info.value.errno == errno.E2BIG
    assert len(listed) == 5  # one past the bound, not the ten there


class _Counting:
    """``os.scandir``'s iterator, counting the entries taken from it."""

    def __init__(self, entries, taken: list) -> None:
        self._entries, self._taken = entries, taken

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._entries.close()

    def __iter__(self):
        for entry in self._entries:
            self._taken.append(entry.name)
            yield entry


def down_reason(store: KVStore) -> str:
    (reason,) = store.stats().paths_down.values()
    return reason


@pytest.mark.parametrize("where", ["segment", "seats"])
def test_a_stuffed_directory_takes_the_path_out_and_the_store_serves_from_memory(
        tmp_path, monkeypatch, where):
    segment = make_cache(tmp_path / "cache")
    for module in (cachedir, slot_files):
        monkeypatch.setattr(module, "SEGMENT_LISTED", BOUND, raising=False)
    monkeypatch.setattr(seats, "SEATS_LISTED", BOUND, raising=False)
    stuffed = segment if where == "segment" else namespace_of(segment) / "seats"
    stuff(stuffed, BOUND)
    tokens = seq(0, 2)
    with KVStore(SMALL, config(tmp_path / "cache", share_writers=4)) as store:
        # its disk tier holds none of the chunks on disk: it holds no segment, and reads
        # the one it could not open as another writer's, verified
        assert store.lookup(tokens).chunks_by_tier == {TierName.SHARED: 2}
        reason = down_reason(store)
        assert f"{stuffed} holds more than {BOUND} entries" in reason, reason
        store.put(tokens, make_kv(tokens))
        assert exact(store, tokens) == len(tokens)
    assert all((stuffed / f"junk-{i}").exists() for i in range(BOUND))  # not kvtier's: left


def test_within_the_bound_the_segment_opens_with_every_chunk(tmp_path, monkeypatch):
    segment = make_cache(tmp_path / "cache")
    for module in (cachedir, slot_files):
        monkeypatch.setattr(module, "SEGMENT_LISTED", BOUND, raising=False)
    stuff(segment, BOUND - len(os.listdir(segment)))
    with KVStore(SMALL, config(tmp_path / "cache", share_writers=4)) as store:
        assert store.stats().paths_down == {}
        assert exact(store, seq(0, 3)) == 3 * CHUNK


def test_this_hosts_segments_are_found_without_listing_writers(tmp_path, monkeypatch):
    """``workers_writer`` finds the segment a store of this process holds under the first
    default id, though ``writers/`` holds 200 other directories and cannot be listed."""
    first = writer_ids(None)[0]
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    with KVStore(SMALL, config(root, share_writers=4, instance_id=first)) as store:
        writers = root / store.namespace.id / "writers"
        for i in range(200):
            (writers / f"other-{i}").mkdir()

        def refused(self, *args):
            raise AssertionError(f"{self.path} was listed")

        for name in ("names", "scan", "listed"):
            monkeypatch.setattr(SafeDir, name, refused, raising=False)
        assert workers_writer((str(root),), store.namespace) == first
