"""The rounds of the remote store's log of token records (``scheduler/remote_events.py``),
against a stand-in log: a chunk the engine learnt the store lost and that is logged again
while a round reads is named again; entries naming nothing count once, however often a
failed round reads them again."""

from array import array

import pytest

pytest.importorskip("vllm")

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import init_none_hash

from kvtier.connector.scheduler import remote_events
from kvtier.connector.scheduler.remote_events import RemoteEvents
from kvtier.io.token_record import encode_record
from kvtier.keys import block_hash_chunk_key
from tests.helpers.recorded_events import HASHING
from tests.helpers.scheduler_side import GEO

NS = GEO.namespace("m", "", 1, 0)
init_none_hash(get_hash_fn_by_name("sha256"))  # (as an engine's start does: a first block's parent)


def entry(n: int) -> tuple[bytes, bytes]:
    """A log entry naming the chunk of ``n`` repeated: its key and its token record."""
    tokens = array("i", [n] * GEO.chunk_tokens)
    key = block_hash_chunk_key(NS, HASHING.block_hashes(None, tokens, GEO.hash_block_tokens)[-1])
    return bytes(key), encode_record(b"", tokens)


class Log:
    """The store's log (entries from ``after``, numbered ``N-0``), every chunk held; a round
    trip asking which are held fails ``failing`` times first; ``before_read(start)`` runs
    as a round reads from ``start``."""

    keeps_records = True

    def __init__(self, entries: list[tuple[bytes, bytes]], failing: int = 0) -> None:
        self.entries, self.failing = entries, failing
        self.before_read = lambda start: None

    def read_records(self, after: bytes, count: int):
        start = int(after.split(b"-")[0])
        self.before_read(start)
        part = self.entries[start:start + count]
        return b"%d-0" % (start + len(part)), part

    def exists_answered(self, keys):
        if self.failing:
            self.failing -= 1
            return None  # the round trip failed: the same entries next round
        return [True] * len(keys)


def test_a_chunk_lost_and_logged_again_while_a_round_reads_is_named_again(monkeypatch):
    monkeypatch.setattr(remote_events, "DUTY", 1.0)  # no rest between batches
    lost = entry(0)
    log = Log([lost])
    events = RemoteEvents(log, NS, GEO, HASHING)
    events._follow()
    assert [f.key for f in events.drain()] == [lost[0]]
    log.entries += [entry(n) for n in range(1, 2 * remote_events.BATCH + 1)]  # a busy log

    def relogged(start: int) -> None:  # mid-round: the engine learns the store lost it, and
        if start == 1 + remote_events.BATCH and lost not in log.entries[1:]:  # writes it again
            events.lost([lost[0]])
            log.entries.insert(start, lost)

    log.before_read = relogged
    events._follow()
    told = [f.blocks is not None for f in events.drain() if f.key == lost[0]]
    assert told == [False, True]  # gone, then named again (before: gone for good)
    assert lost[0] in events._named


def test_entries_naming_nothing_count_once_however_often_a_round_is_read_again():
    log = Log([(bytes([i]) * 16, b"garbage") for i in range(5)] + [entry(1)], failing=3)
    events = RemoteEvents(log, NS, GEO, HASHING)
    for _ in range(5):
        events._follow()
    assert events.unnamed == 5 and len(events.drain()) == 1  # before: 5 more each failed round
