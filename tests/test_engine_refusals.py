"""A put whose write-through the I/O engine refuses (the store closing beside it) finishes
every reservation of its run: no chunk is left being stored for ever, so each can be stored
again, and nothing stays pinned."""

import pytest

from kvtier import KVStore
from kvtier.tiers.base import TierName
from tests.helpers.fake_io import FakeEngine
from tests.helpers.kv import SMALL, index_of, make_kv
from tests.helpers.store import config, exact, seq


def test_a_refused_write_through_leaves_no_reservation_of_the_run(tmp_path):
    make, built = FakeEngine.factory()
    with KVStore(SMALL, config(tmp_path, host_chunks=8), io_engine=make) as store:
        tokens = seq(0, 4)  # one run of four chunks: one copy, then four write-throughs
        built[0].refuse()
        with pytest.raises(RuntimeError, match="closed"):
            store.put(tokens, make_kv(tokens))
        built[0].heal()
        for tier in (TierName.HOST, TierName.DISK):
            census = index_of(store, tier).census()
            assert census.writing == 0 and census.pins == 0, (tier, census)
        store.put(tokens, make_kv(tokens))  # the chunks not kept are stored now
        assert store.flush(10).not_written == 0
        assert exact(store, tokens)


def test_a_flush_whose_sync_job_fails_says_false_and_raises_nothing(tmp_path):
    """A sync job that raises (an unexpected error, or cancelled at a close) is a sync that
    failed: the flush is false, never an exception to its caller."""
    make, built = FakeEngine.factory()
    with KVStore(SMALL, config(tmp_path, host_chunks=8), io_engine=make) as store:
        tokens = seq(0, 2)
        store.put(tokens, make_kv(tokens))
        assert store.flush(10)
        store.put(seq(100, 2), make_kv(seq(100, 2)))
        built[0].fail(OSError(5, "Input/output error"))
        assert not store.flush(10)
        built[0].heal()
