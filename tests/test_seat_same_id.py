"""Two processes of one host claiming the last free seat under one writer id at the same
moment (both start with the first default id before either has made its segment): the one
that does not get the seat moves on to its next id, and never reads the shared directory
under the other's id (it would skip the other's chunks as its own)."""

import errno

import pytest

from kvtier import KVStore
from kvtier.io.safefs import SafeDir
from kvtier.segment.cachedir import CacheDirError
from kvtier.segment.seats import claim_seat
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.seat_races import claims_meanwhile, started_together
from tests.helpers.store import config, seq


def test_a_seat_taken_under_ones_own_id_meanwhile_is_busy_not_full(tmp_path):
    """share_writers 1, an empty directory: another process takes the one seat under the
    same id between this claim's count and its take. The claim fails as busy (EBUSY: its
    id is another process's now, try the next), not as "no seat free" under that id."""
    ns = tmp_path / "ns"
    ns.mkdir()
    with claims_meanwhile(ns, "w-0", 1) as raced, SafeDir.open(ns) as directory, \
            pytest.raises(CacheDirError) as caught:
        claim_seat(directory, "w-0", 1)
    assert caught.value.errno == errno.EBUSY and "w-0" in str(caught.value)
    assert raced


def test_the_engine_left_without_the_last_seat_reads_the_others_chunks(tmp_path):
    """Default ids, share_writers 1: the second engine starts (and takes the one seat under
    the first id) while the first is claiming that seat under that id. The first has no
    seat, under its next id: it writes nothing, and reads what the second wrote."""
    first, second = started_together(
        lambda: KVStore(SMALL, config(tmp_path, share_writers=1, share_refresh="1h")))
    try:
        assert not second.stats().paths_down and first.stats().paths_down
        assert first.disk.writer != second.disk.writer
        tokens = seq(0, 2)
        second.put(tokens, make_kv(tokens))
        assert second.flush()
        first._state.others.refresh()
        assert first.lookup(tokens).tokens == 2 * CHUNK
    finally:
        first.close()
        second.close()
