"""GET replies read off a socket straight into the caller's buffers (``kvtier.remote.resp``):
values, both nulls, errors, values of a length not asked for (skipped, the stream kept in
step), and streams that are cut or not RESP, however the stream is split; what error
replies say of where a key lives (``Refusals``)."""

import socket
import threading

import pytest

from kvtier.remote.resp import BulkReplies, Refusals, RespError, TooLong


def replies(*chunks: bytes) -> BulkReplies:
    ours, theirs = socket.socketpair()
    ours.settimeout(5)

    def send() -> None:
        for chunk in chunks:
            theirs.sendall(chunk)
        theirs.close()

    threading.Thread(target=send, daemon=True).start()
    return BulkReplies(ours)


def buffers(header: int = 4, payload: int = 6) -> tuple[memoryview, memoryview]:
    return memoryview(bytearray(header)), memoryview(bytearray(payload))


def test_values_nulls_and_errors_in_order_split_anyhow():
    stream = b"$10\r\nHEADpaylod\r\n$-1\r\n_\r\n-ERR wrong type\r\n$10\r\nhead012345\r\n"
    r = replies(*[stream[i:i + 3] for i in range(0, len(stream), 3)])  # bytes trickle in
    header, payload = buffers()
    assert r.bulk_into(header, payload) == "" and bytes(header) == b"HEAD" and bytes(payload) == b"paylod"
    assert r.bulk_into(*buffers()) is None
    assert r.bulk_into(*buffers()) is None
    assert r.bulk_into(*buffers()) == "ERR wrong type"
    header, payload = buffers()
    assert r.bulk_into(header, payload) == "" and bytes(header) + bytes(payload) == b"head012345"


def test_a_value_of_another_length_is_skipped_and_the_next_one_read():
    big = b"x" * (3 << 20)
    r = replies(b"$%d\r\n" % len(big), big, b"\r\n$10\r\n0123456789\r\n")
    assert r.bulk_into(*buffers()) == f"wrong length: a value of {len(big)} bytes"
    header, payload = buffers()
    assert r.bulk_into(header, payload) == "" and bytes(header) + bytes(payload) == b"0123456789"


@pytest.mark.parametrize(("stream", "error"), [
    (b"$10\r\nshort", ConnectionError),
    (b"", ConnectionError),
    (b"*2\r\n", RespError),
    (b"$ten\r\n", RespError),
    (b"$10\r\n0123456789XY", RespError),
    (b"+" + b"a" * 5000, RespError),
])
def test_a_stream_cut_or_not_resp_raises_so_the_connection_is_dropped(stream, error):
    with pytest.raises(error):
        replies(stream).bulk_into(*buffers())


def test_a_range_reply_fills_several_views_and_an_empty_one_is_a_missing_key():
    r = replies(b"$9\r\nHDRab", b"cdef\r\n$0\r\n\r\n$3\r\nxyz\r\n")
    views = [memoryview(bytearray(n)) for n in (3, 2, 4)]
    assert r.bulk_into(*views) == "" and [bytes(v) for v in views] == [b"HDR", b"ab", b"cdef"]
    assert r.bulk_into(*buffers()) is None  # GETRANGE of a key that is not there
    view = memoryview(bytearray(3))
    assert r.bulk_into(view) == "" and bytes(view) == b"xyz"  # still in step


def test_a_value_far_longer_than_asked_is_not_read_through():
    """(a hostile writer's value of hundreds of MiB under a key: read through, it ran every
    read of it past the round trip's deadline, and the store was taken out of service)"""
    r = replies(b"$%d\r\n" % ((1 << 30) + 10), b"x" * 4096)  # the rest never comes
    with pytest.raises(TooLong, match="wrong length"):
        r.bulk_into(*buffers())


class Pieces:
    """A socket whose reads hand the stream out in the pieces given, one at most a read."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = [bytearray(p) for p in pieces if p]

    def recv_into(self, view: memoryview, *_: int) -> int:
        if not self.pieces:
            return 0
        n = min(len(view), len(self.pieces[0]))
        view[:n] = self.pieces[0][:n]
        del self.pieces[0][:n]
        if not self.pieces[0]:
            self.pieces.pop(0)
        return n


def read_all(r: BulkReplies) -> list:
    """Every reply of ``SPLIT``, as read."""
    out = []
    for _ in range(6):
        header, payload = buffers()
        out.append((r.bulk_into(header, payload), bytes(header), bytes(payload)))
    views = [memoryview(bytearray(n)) for n in (3, 2, 4)]
    return [*out, (r.bulk_into(*views), [bytes(v) for v in views])]


SPLIT = (b"$10\r\nHEADpaylod\r\n$-1\r\n_\r\n-ASK 12 10.0.0.1:7001\r\n$3\r\nabc\r\n$0\r\n\r\n"
         b"$9\r\nHDRabcdef\r\n")


def test_replies_split_at_every_byte_read_the_same():
    whole = read_all(BulkReplies(Pieces([SPLIT])))
    assert [w[0] for w in whole] == ["", None, None, "ASK 12 10.0.0.1:7001",
                                     "wrong length: a value of 3 bytes", None, ""]
    assert read_all(BulkReplies(Pieces([SPLIT[i:i + 1] for i in range(len(SPLIT))]))) == whole
    for i in range(len(SPLIT)):
        for j in range(i, len(SPLIT), 7):
            assert read_all(BulkReplies(Pieces([SPLIT[:i], SPLIT[i:j], SPLIT[j:]]))) == whole


def test_error_replies_say_where_a_key_lives():
    from redis.exceptions import BusyLoadingError

    refusals = Refusals()
    refusals.clear()
    for at, error in enumerate(["ASK 12 10.0.0.1:7001", "MOVED 12 ::1:7002", "TRYAGAIN x",
                                "READONLY You can't write", "ERR other", "MOVED 12 :7003"]):
        refusals.note(at, error)
    assert refusals.targets == {0: (True, "10.0.0.1", 7001), 1: (False, "::1", 7002)}
    assert refusals.stale and refusals.replica and not refusals.loading
    refusals.note(9, "LOADING Redis is loading the dataset in memory")
    with pytest.raises(BusyLoadingError, match="loading"):  # what redis-py raises
        refusals.settle()
