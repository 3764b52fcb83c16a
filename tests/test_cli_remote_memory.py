"""``kvtier inspect URL`` reads a value it checks in bounded pieces, never whole (issue 40,
finding 8): a 50 MiB value under a kvtier-form key is checked down to its checksum while
the survey's memory stays far below the value's size; a value in parts is checked part by
part across pieces that do not fall on its parts' bounds."""

import json
import subprocess
import sys

import numpy as np
import pytest

from kvtier.keys import ChunkKey
from kvtier.ops.value_reads import check_value
from kvtier.remote.values import ValueFormat, value_key
from tests.helpers.redis_server import RedisServer, needs_redis

pytestmark = needs_redis
BIG = 50 * 2**20
PEAK_LIMIT = 8 * 2**20  # what the survey may hold at once, against a 50 MiB value

# The survey of one store in a process of its own, its Python allocations traced (what it
# imports loaded first: modules are not what it holds).
SURVEY = """
import json, sys, tracemalloc
import redis.exceptions
from kvtier.ops.remote_survey import survey
from kvtier.remote.redis_client import connect
from kvtier.units import format_size
tracemalloc.start()
found = survey(sys.argv[1])
print(json.dumps({"peak": tracemalloc.get_traced_memory()[1], "found": found.as_dict()}))
"""


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def put_value(client, namespace: bytes, key: bytes, raw_bytes: int, parts=()) -> bytes:
    """Store a chunk of ``raw_bytes`` random bytes as kvtier writes it; returns its key."""
    payload = np.random.default_rng(raw_bytes).integers(0, 256, raw_bytes, dtype=np.uint8)
    name = value_key("kvtier:", namespace, ChunkKey(key))
    client.set(name, bytes(ValueFormat(namespace, raw_bytes, parts).encode(ChunkKey(key), payload)))
    return name


def flip_byte(client, name: bytes, at: int) -> None:
    client.setrange(name, at, bytes([client.getrange(name, at, at)[0] ^ 1]))


def test_a_50_mib_value_is_checked_without_holding_it(server):
    client = server.client()
    good = put_value(client, b"\x01" * 16, b"\x02" * 16, BIG)
    bad = put_value(client, b"\x03" * 16, b"\x04" * 16, BIG)
    flip_byte(client, bad, client.strlen(bad) - 1)
    result = subprocess.run([sys.executable, "-c", SURVEY, server.url], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    held = {h["digest"]: h for h in data["found"]["namespaces"]}
    ok, damaged = held[(b"\x01" * 16).hex()], held[(b"\x03" * 16).hex()]
    assert (ok["checked"], ok["bad"], ok["chunk_sizes"]) == (1, 0, "50 MiB")
    assert (damaged["checked"], damaged["bad"]) == (1, 1)
    assert data["peak"] < PEAK_LIMIT, f"the survey held {data['peak']} bytes at once"
    assert client.strlen(good) > BIG


@pytest.mark.parametrize("piece", [1000, 4096, 1 << 20])
def test_a_value_in_parts_is_checked_part_by_part_across_pieces(server, piece):
    client = server.client()
    parts = (3 * 4096, 5 * 4096)
    name = put_value(client, b"\x05" * 16, b"\x06" * 16, sum(parts), parts)
    header_bytes = ValueFormat(b"\x05" * 16, sum(parts), parts).header_bytes
    found = check_value(client, name, "kvtier:", piece)
    assert found is not None and found.problem == "" and found.payload_bytes == sum(parts)
    flip_byte(client, name, header_bytes + parts[0] + 7)  # in the second part
    assert check_value(client, name, "kvtier:", piece).problem == "payload damaged"


def test_a_value_under_another_chunks_key_or_gone_is_told_apart(server):
    client = server.client()
    name = put_value(client, b"\x07" * 16, b"\x08" * 16, 8192)
    other = value_key("kvtier:", b"\x07" * 16, ChunkKey(b"\x09" * 16))
    client.copy(name, other)
    assert check_value(client, other, "kvtier:").problem == "holds another chunk"
    client.setrange(name, 0, b"\xff" * 8)  # its header no longer checks out
    assert check_value(client, name, "kvtier:").problem not in ("", "payload damaged")
    assert check_value(client, b"kvtier:gone", "kvtier:") is None
