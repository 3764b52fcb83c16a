"""The values of Mooncake Store's log of token records (``kvtier/remote/mooncake_log.py``),
without a store: batches split within their bounds, parsed back whole, and any other bytes
(cut, grown, another seq's, random) read as no batch, never raising; cursors and head hints
the same. The log against a real store: tests/mooncake_inner_records.py."""

import random

from kvtier.keys import ChunkKey
from kvtier.remote.mooncake_log import (
    BATCH_BYTES,
    ENTRIES,
    pack_batch,
    pack_head,
    parse_cursor,
    split,
    unpack_batch,
    unpack_head,
)


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def test_appends_split_into_batches_within_their_bounds_in_order():
    items = [(key(i), bytes([i % 256]) * 1100) for i in range(300)]
    batches, dropped = split(items)
    assert dropped == 0 and [e for b in batches for e in b] == [(bytes(k), r) for k, r in items]
    assert all(len(b) <= ENTRIES and len(pack_batch(1, b)) <= BATCH_BYTES for b in batches)
    big = [(key(1), b"x" * 5000)] * 40  # 40 records of 5 KiB: by bytes, not count
    batches, _ = split(big)
    assert len(batches) == 2 and all(len(pack_batch(1, b)) <= BATCH_BYTES for b in batches)
    assert split([(key(1), b"x" * BATCH_BYTES), (key(2), b"ok")]) == ([[(bytes(key(2)), b"ok")]], 1)


def test_a_batch_reads_back_only_whole_and_under_its_own_seq():
    entries = [(bytes(key(i)), b"r" * i) for i in range(10)]
    value = pack_batch(7, entries)
    assert unpack_batch(value, 7) == entries
    assert unpack_batch(pack_batch(7, []), 7) == []
    assert unpack_batch(value, 8) is None  # another seq's batch
    for cut in range(len(value)):
        assert unpack_batch(value[:cut], 7) is None
    assert unpack_batch(value + b"\0", 7) is None
    assert unpack_batch(b"KVRL" + b"\xff" * 100, 7) is None
    too_many = pack_batch(7, [(b"k", b"r")] * (ENTRIES + 1))
    assert unpack_batch(too_many, 7) is None


def test_random_and_damaged_bytes_never_raise():
    rng = random.Random(5)
    value = pack_batch(3, [(bytes(key(1)), b"abc"), (bytes(key(2)), b"defg")])
    for _ in range(3000):
        damaged = bytearray(value)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        answer = unpack_batch(bytes(damaged), 3)
        assert answer is None or all(isinstance(k, bytes) and isinstance(r, bytes) for k, r in answer)
        noise = rng.randbytes(rng.randrange(80))
        assert unpack_batch(noise, 3) is None
        assert isinstance(unpack_head(noise), int)
        assert parse_cursor(noise) is None or parse_cursor(noise)[0] > 0


def test_head_hints_and_cursors_are_parsed_with_bounds():
    assert unpack_head(pack_head(12)) == 12
    assert unpack_head(pack_head(12)[:-1]) == 0 and unpack_head(-704) == 0
    assert unpack_head(b"KVRX" + pack_head(12)[4:]) == 0
    assert unpack_head(pack_head(10**18 - 1)) == 10**18 - 1 and unpack_head(pack_head(10**18)) == 0
    assert parse_cursor(b"%d.3" % (10**18 - 1)) == (10**18 - 1, 3)
    assert parse_cursor(b"0") is None and parse_cursor(b"") is None
    assert parse_cursor(b"17") == (17, None) and parse_cursor(b"17.5") == (17, 5)
    for junk in (b"-1", b"1.2.3", b"9" * 40, b"1-0", b" 1", b"1.", "17"):
        assert parse_cursor(junk) is None  # type: ignore[arg-type]
