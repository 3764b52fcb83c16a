"""A remote store's log of token records (``RemoteTier.append_records``/``read_records``) on
Valkey/Redis, against a real redis-server and a one-node cluster: entries come back in
order from any point, the log is trimmed to about ``RECORD_LOG``, entries another writer
shaped otherwise are passed over, ``XRANGE`` replies are read with bounds, and a store that
is down answers None, never raises."""

import socket
import time

import pytest

from kvtier.keys import ChunkKey, Namespace
from kvtier.remote import redis_tier
from kvtier.remote.record_log import ENTRY_MAX, TOO_LARGE, LogEntries, read_entries
from kvtier.remote.redis_tier import RedisTier
from kvtier.remote.resp import BulkReplies, RespError
from tests.helpers.redis_server import RedisServer, needs_redis

pytestmark = needs_redis
NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)


# round trips on a loaded machine (engine tests beside these) may take over the 1 s default
LOADED = 5.0


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def read_all(tier: RedisTier, after: bytes = b"0", count: int = 7) -> tuple[bytes, list]:
    entries: list = []
    while True:
        answer = tier.read_records(after, count)
        assert answer is not None
        after, got = answer
        entries += got
        if len(got) < count:
            return after, entries


@pytest.mark.parametrize("cluster", [False, True])
def test_records_come_back_in_order_from_any_point(tmp_path, cluster):
    server = RedisServer(tmp_path, *(("--cluster-enabled", "yes", "--cluster-config-file",
                                      "nodes.conf") if cluster else ())).start()
    try:
        if cluster:
            client = server.client()
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            deadline = time.monotonic() + 30
            while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        url = f"redis+cluster://127.0.0.1:{server.port}" if cluster else server.url
        tier = RedisTier(url, NS, 4096, timeout_s=LOADED)
        assert tier.keeps_records
        assert tier.read_records(b"0", 10) == (b"0", [])  # no log yet
        items = [(key(i), bytes([i]) * (10 + i)) for i in range(20)]
        assert tier.append_records(items[:12]) and tier.append_records(items[12:])
        last, entries = read_all(tier)
        assert entries == [(bytes(k), r) for k, r in items]
        assert tier.read_records(last, 10) == (last, [])  # nothing after the last
        tier.append_records([(key(99), b"new")])
        assert read_all(tier, last)[1] == [(bytes(key(99)), b"new")]
        tier.close()
    finally:
        server.stop()


def test_the_log_is_trimmed_to_about_its_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(redis_tier, "RECORD_LOG", 100)
    server = RedisServer(tmp_path).start()
    try:
        tier = RedisTier(server.url, NS, 4096, timeout_s=LOADED)
        for start in range(0, 2000, 100):
            assert tier.append_records([(key(i), b"r") for i in range(start, start + 100)])
        _, entries = read_all(tier, count=500)
        assert 100 <= len(entries) < 400  # MAXLEN ~: whole nodes of the stream go
        assert entries[-1] == (bytes(key(1999)), b"r")
        tier.close()
    finally:
        server.stop()


def test_entries_shaped_otherwise_are_passed_over(tmp_path):
    server = RedisServer(tmp_path).start()
    try:
        tier = RedisTier(server.url, NS, 4096, timeout_s=LOADED)
        tier.append_records([(key(1), b"one")])
        log_key = f"kvtier:log:{NS.digest().hex()}"
        client = server.client()
        client.xadd(log_key, {"x": "y"})
        client.xadd(log_key, {"k": b"only a key"})
        tier.append_records([(key(2), b"two")])
        assert read_all(tier)[1] == [(bytes(key(1)), b"one"), (bytes(key(2)), b"two")]
        client.delete(log_key)
        client.set(log_key, b"not a stream")
        assert tier.read_records(b"0", 10) is None  # WRONGTYPE: no log to read
        tier.close()
    finally:
        server.stop()


def entries(*chunks: bytes, count: int = 8):
    """What ``read_entries`` makes of an XRANGE reply sent as ``chunks``."""
    ours, theirs = socket.socketpair()
    ours.settimeout(5)
    with ours, theirs:
        theirs.sendall(b"".join(chunks))
        theirs.shutdown(socket.SHUT_WR)
        return read_entries(BulkReplies(ours), b"0-1", count)


def entry(ident: bytes, *fields: bytes, kind: bytes = b"*") -> bytes:
    items = len(fields) // 2 if kind == b"%" else len(fields)
    return b"*2\r\n$%d\r\n%s\r\n%s%d\r\n" % (len(ident), ident, kind, items) + b"".join(
        b"$%d\r\n%s\r\n" % (len(f), f) for f in fields)


def test_an_xrange_reply_is_read_with_bounds_whatever_its_entries_hold():
    assert entries(b"*0\r\n") == LogEntries(b"0-1", [])
    assert entries(b"-WRONGTYPE Operation against a key\r\n") == "WRONGTYPE Operation against a key"
    shapes = [entry(b"1-0", b"x", b"y"), entry(b"2-0", b"k", b"a"), entry(b"3-0"),
              entry(b"4-0", b"r", b"b", b"k", b"a", b"z", b"!"), entry(b"5-0", b"k", b"c", b"r", b"d",
                                                                      kind=b"%")]
    assert entries(b"*5\r\n", *shapes) == LogEntries(b"5-0", [(b"a", b"b"), (b"c", b"d")])
    huge = b"*2\r\n$3\r\n6-0\r\n*4\r\n$1\r\nk\r\n$%d\r\n" % (1 << 30)  # its bytes never come
    assert entries(b"*2\r\n", shapes[3], huge) == LogEntries(b"6-0", [(b"a", b"b"), TOO_LARGE], b"6-0")
    many = entry(b"7-0", *[b"f"] * (2 * ENTRY_MAX // 6))  # small fields, too many of them
    assert entries(b"*1\r\n", many).passed == b"7-0"
    for junk in (b"+OK\r\n", b"*9\r\n", b"*1\r\n*3\r\n", b"*1\r\n*2\r\n$99\r\n"):
        with pytest.raises((RespError, ConnectionError)):
            entries(junk)


def test_a_store_that_is_down_answers_none_and_false(tmp_path):
    server = RedisServer(tmp_path).start()
    tier = RedisTier(server.url, NS, 4096, timeout_s=0.5, retry_s=60)
    server.stop()
    assert tier.append_records([(key(1), b"r")]) is False
    assert tier.read_records(b"0", 10) is None
    assert tier.down
    tier.close()


def test_kvtier_inspect_counts_a_log_apart_from_keys_that_are_not_kvtiers(tmp_path):
    from kvtier.ops.remote_survey import survey

    server = RedisServer(tmp_path).start()
    try:
        tier = RedisTier(server.url, NS, 4096, timeout_s=LOADED)
        tier.append_records([(key(1), b"r")])
        server.client().set(b"kvtier:junk", b"x")
        found = survey(server.url)
        assert (found.record_logs, found.foreign_keys) == (1, 1)
        tier.close()
    finally:
        server.stop()
