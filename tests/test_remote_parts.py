"""A hybrid model's chunks in the remote store, in parts (one per KV cache group, each with
its own checksum in the value's part table): the value format, and on Redis a load that
fills only some groups reading the header and those parts only (GETRANGE, one pipelined
trip), each checked, a batch staying in step through an error reply. Damage in a part read
or not, in the table, a value of another layout, a store down and a cluster: every
backend's, in tests/test_remote_contract.py."""

import numpy as np
import pytest

from kvtier.io.format import HeaderError
from kvtier.io.result import IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.redis_tier import RedisTier
from kvtier.remote.values import INDEX_ENTRY_BYTES, ValueFormat, decode_value_header, value_key
from tests.helpers.redis_server import RedisServer, needs_redis

PARTS = (8192, 24576, 16384, 16384)  # a full group's part, then sliding ones
RAW = sum(PARTS)
NS = Namespace(model="hybrid", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
FORM = ValueFormat(NS.digest(), RAW, PARTS)
SPANS = FORM.spans


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, RAW, dtype=np.uint8)


# -- the value format, no store --------------------------------------------------------------

def test_a_value_in_parts_carries_its_table_and_checks_each_part():
    value = FORM.encode(key(1), chunk(1))
    assert FORM.header_bytes == INDEX_ENTRY_BYTES + 16 * len(PARTS)
    header, size = decode_value_header(value)
    assert size == FORM.header_bytes and [n for n, _ in header.parts] == list(PARTS)
    assert FORM.value_problem(value, key(1)) == ""
    assert FORM.value_problem(value, key(2)) == "value holds another chunk"
    damaged = bytearray(value)
    damaged[FORM.header_bytes + SPANS[2][0] + 5] ^= 1
    assert FORM.value_problem(damaged, key(1)) == "payload checksum mismatch"
    # read in part: only the parts read are checked
    payload = np.frombuffer(damaged, np.uint8, offset=FORM.header_bytes)
    head = damaged[:FORM.header_bytes]
    assert FORM.parts_problem(head, payload, key(1), {0, 1}) == ""
    assert FORM.parts_problem(head, payload, key(1), {0, 2}) == "part 2: payload checksum mismatch"


def test_a_torn_table_or_another_layout_is_refused():
    value = bytearray(FORM.encode(key(1), chunk(1)))
    torn = bytearray(value)
    torn[INDEX_ENTRY_BYTES + 3] ^= 1
    assert "part table checksum" in FORM.value_problem(torn, key(1))
    assert "truncated to 136 bytes" in FORM.value_problem(value[:INDEX_ENTRY_BYTES + 8], key(1))
    with pytest.raises(HeaderError, match="inside its part table"):
        decode_value_header(value[:INDEX_ENTRY_BYTES + 8])
    other = ValueFormat(NS.digest(), RAW, (RAW // 2, RAW // 2))
    assert "this tier's are" in other.value_problem(value, key(1))
    whole = ValueFormat(NS.digest(), RAW)
    assert "this tier's are" in whole.value_problem(value, key(1))
    assert "this tier's are" in FORM.value_problem(whole.encode(key(1), chunk(1)), key(1))


def test_ranges_join_adjacent_parts():
    assert FORM.ranges({0, 1, 3}) == [(0, SPANS[1][1]), SPANS[3]]
    assert FORM.ranges({2}) == [SPANS[2]]
    assert FORM.reads_alone({0, 1}) and not FORM.reads_alone(range(4))
    assert not ValueFormat(NS.digest(), RAW).reads_alone({0})
    with pytest.raises(ValueError, match="adding up to the chunk"):
        ValueFormat(NS.digest(), RAW, (RAW, 1))


# -- Redis ---------------------------------------------------------------------------------

@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def tier(url: str, parts=PARTS, **options) -> RedisTier:
    return RedisTier(url, NS, RAW, **{"timeout_s": 5.0, "retry_s": 0.3, "parts": parts, **options})


def sent_bytes(server) -> int:
    return int(server.client().info("stats")["total_net_output_bytes"])


def read_parts(t: RedisTier, keys, wanted):
    dsts = [np.full(RAW, 7, np.uint8) for _ in keys]
    return t.get_parts(keys, dsts, wanted), dsts


def check_parts(dst: np.ndarray, i: int, wanted) -> None:
    for p, (at, end) in enumerate(SPANS):
        expected = chunk(i)[at:end] if p in wanted else np.full(end - at, 7, np.uint8)
        assert np.array_equal(dst[at:end], expected), f"part {p}"


@needs_redis
def test_a_read_in_part_moves_only_the_parts_it_needs(server):
    t = tier(server.url)
    assert all(r.ok for r in t.put_many([(key(i), chunk(i)) for i in range(6)]))
    wanted = [{0}, {0, 2}, {1, 3}, {0}, set(range(4)), {3}]
    before = sent_bytes(server)
    results, dsts = read_parts(t, [key(i) for i in range(6)], wanted)
    moved = sent_bytes(server) - before
    assert [r.status for r in results] == [IOStatus.OK] * 6
    for i, parts in enumerate(wanted):
        check_parts(dsts[i], i, parts)
        assert results[i].nbytes == sum(SPANS[p][1] - SPANS[p][0] for p in parts)
    needed = sum(r.nbytes for r in results)
    assert needed < moved < needed + 6 * (FORM.header_bytes + 256) + 4096
    dst = np.zeros(RAW, np.uint8)
    assert t.get_many([key(2)], [dst])[0].ok and np.array_equal(dst, chunk(2))  # whole, too
    t.close()


def test_what_the_replies_of_a_read_in_part_come_to():
    from kvtier.remote.range_reads import RangeRead

    def read(answers, header=None, payload=None):
        plan = RangeRead(FORM, key(1), np.zeros(RAW, np.uint8), {0, 2})
        value = FORM.encode(key(1), chunk(1))
        plan.header[:] = value[:FORM.header_bytes] if header is None else header
        plan.payload[:] = np.frombuffer(value, np.uint8, offset=FORM.header_bytes) \
            if payload is None else payload
        return plan.outcome(answers)

    assert len(RangeRead(FORM, key(1), np.zeros(RAW, np.uint8), {0, 2}).runs) == 2
    assert read(["", ""]).status is IOStatus.OK
    assert read([None, None]).status is IOStatus.MISSING
    assert read(["", None]).status is IOStatus.MISSING  # evicted between its reads
    assert read(["", "wrong length: a value of 3 bytes"]).status is IOStatus.CORRUPT
    assert read(["WRONGTYPE Operation", ""]).status is IOStatus.CORRUPT  # a key not kvtier's
    assert read(["MOVED 1234 127.0.0.1:7001", ""]).status is IOStatus.IO_ERROR  # no news
    other = bytes(FORM.encode(key(1), chunk(2)))  # replaced between the reads: A's header, B's part
    replaced = read(["", ""], payload=np.frombuffer(other, np.uint8, offset=FORM.header_bytes))
    assert replaced.status is IOStatus.CORRUPT, replaced


@needs_redis
def test_a_batch_of_whole_and_part_reads_and_an_error_reply_stays_in_step(server):
    t = tier(server.url)
    t.put_many([(key(i), chunk(i)) for i in range(4)])
    raw = server.client()
    raw.rpush(value_key("kvtier:", NS.digest(), key(9)), b"x")  # not a string: WRONGTYPE
    name = value_key("kvtier:", NS.digest(), key(3))
    damaged = bytearray(raw.get(name))
    damaged[FORM.header_bytes + SPANS[1][0] + 3] ^= 1
    raw.set(name, bytes(damaged))
    wanted = [{0}, set(range(4)), {1, 2}, set(range(4)), {0}, {0}]
    results, dsts = read_parts(t, [key(0), key(1), key(9), key(3), key(7), key(2)], wanted)
    assert [r.status for r in results] == [IOStatus.OK, IOStatus.OK, IOStatus.CORRUPT,
                                           IOStatus.CORRUPT, IOStatus.MISSING, IOStatus.OK]
    check_parts(dsts[0], 0, {0})
    assert np.array_equal(dsts[1], chunk(1)) and results[1].nbytes == RAW  # whole, checked
    check_parts(dsts[5], 2, {0})
    t.close()
