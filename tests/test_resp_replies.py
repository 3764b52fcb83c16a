"""GET replies read off a socket straight into the caller's buffers (``kvtier.remote.resp``):
values, both nulls, errors, values of a length not asked for (skipped, the stream kept in
step), and streams that are cut or not RESP."""

import socket
import threading

import pytest

from kvtier.remote.resp import BulkReplies, RespError, TooLong


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
