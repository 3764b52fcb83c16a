"""``kvtier inspect URL`` and ``kvtier stats`` for the remote tier, run as a user runs them
(a separate process), against a real redis-server."""

import json
import socket
import time

import numpy as np
import pytest

from kvtier import KVStore
from tests.helpers.cli import run
from tests.helpers.drip_proxy import DripProxy
from tests.helpers.kv import CHUNK, SMALL, make_kv
from tests.helpers.redis_server import RedisServer, needs_redis

pytestmark = needs_redis
CHUNK_BYTES = SMALL.token_bytes * CHUNK


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis", "--maxmemory", "64mb",
                      "--maxmemory-policy", "allkeys-lru").start()
    yield srv
    srv.stop()


def fill(server, model: str, chunks: int, metrics_port: int | None = None) -> KVStore:
    store = KVStore(SMALL, {"chunk_tokens": CHUNK, "host_capacity": 64 * CHUNK_BYTES,
                            "remote_url": server.url, "metrics_port": metrics_port}, model=model)
    toks = np.random.default_rng(len(model)).integers(0, 30000, chunks * CHUNK).tolist()
    store.put(toks, make_kv(toks))
    store.flush(10)
    return store


def test_inspect_lists_each_namespace_in_the_store_and_checks_a_sample(server):
    a, b = fill(server, "model-a", 5), fill(server, "model-bb", 3)
    server.client().set(b"kvtier:not-ours", b"x")
    result = run("inspect", server.url, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    held = {h["digest"]: h for h in data["namespaces"]}
    assert held[a.namespace.digest().hex()]["chunks"] == 5
    assert held[b.namespace.digest().hex()]["chunks"] == 3
    assert all(h["checked"] > 0 and h["bad"] == 0 for h in held.values())
    assert held[a.namespace.digest().hex()]["value_bytes"] == 5 * (CHUNK_BYTES + 128)
    assert data["foreign_keys"] == 1 and data["complete"]
    assert data["server"]["maxmemory_policy"] == "allkeys-lru"
    table = run("inspect", server.url)
    assert table.returncode == 0 and "model" not in table.stderr
    assert a.namespace.digest().hex()[:12] in table.stdout and "allkeys-lru" in table.stdout
    a.close()
    b.close()


def test_inspect_exits_1_when_a_value_checked_is_damaged(server):
    fill(server, "m", 1).close()
    (name,) = list(server.client().scan_iter(match="kvtier:*"))
    value = bytearray(server.client().get(name))
    value[-1] ^= 1
    server.client().set(name, bytes(value))
    result = run("inspect", server.url, "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout)["namespaces"][0]["bad"] == 1


@pytest.mark.parametrize(("url", "message"), [
    ("redis://user:pw@127.0.0.1:6379/0", "credentials"),
    ("mooncake://127.0.0.1:50051", "cannot list their keys"),
    ("redis://127.0.0.1:1/0", "127.0.0.1:1"),
    ("redis+cluster://127.0.0.1:1", "127.0.0.1:1"),  # a cluster's client connects as it is made
])
def test_inspect_of_a_store_it_cannot_read_is_one_clear_line(url, message):
    result = run("inspect", url)
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_inspect_lists_the_keyspace_once_however_many_namespaces_it_holds(server):
    from kvtier.ops.remote_survey import survey

    client = server.client()
    pipe = client.pipeline(transaction=False)
    for i in range(300):  # anyone may write keys shaped like kvtier's: one per "namespace"
        pipe.set(b"kvtier:%032x:%032x" % (i, i), b"x")
    pipe.execute()
    client.config_resetstat()
    found = survey(server.url, sample=2)
    assert len(found.namespaces) == 300 and all(h.checked == 1 for h in found.namespaces)
    assert client.info("commandstats")["cmdstat_scan"]["calls"] <= 3  # not one scan each


def test_stats_shows_the_remote_tier(server):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = fill(server, "m", 2, metrics_port=port)
    try:
        result = run("stats", f"127.0.0.1:{port}", "--json")
        assert result.returncode == 0, result.stderr
        values = {(s["name"], tuple(sorted(s["labels"].items()))): s["value"]
                  for s in json.loads(result.stdout)["samples"]}
        assert values[("kvtier_remote_chunks_total", (("backend", "redis"), ("direction", "write")))] == 2
        assert values[("kvtier_remote_up", (("backend", "redis"),))] == 1
        assert "remote_chunks_total" in run("stats", f"127.0.0.1:{port}").stdout
    finally:
        store.close()


def test_inspect_without_the_redis_client_says_which_extra_to_install(tmp_path):
    blocker = tmp_path / "redis.py"
    blocker.write_text("raise ImportError('no redis here')\n")
    result = run("inspect", "redis://127.0.0.1:6379/0", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 2 and "kvtier[remote]" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("args", "says"), [(("--limit", "0"), "--limit"),
                                            (("--limit", "-1"), "--limit"),
                                            (("--namespace", ""), "--namespace is empty")])
def test_inspect_of_a_store_refuses_a_limit_below_one_and_an_empty_namespace(args, says):
    """Both were taken (``listed the first 0 keys only``, exit 0; every namespace for an
    empty one, as an unset shell variable gives: a review), before any connection."""
    result = run("inspect", "redis://127.0.0.1:1/0", *args)
    assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr


def test_inspect_checks_every_part_of_a_hybrid_models_values(server):
    from kvtier.keys import ChunkKey, Namespace
    from kvtier.remote.redis_tier import RedisTier

    ns = Namespace(model="hybrid", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
    parts = (4096, 8192, 4096)
    tier = RedisTier(server.url, ns, sum(parts), parts=parts)
    rng = np.random.default_rng(3)
    assert all(r.ok for r in tier.put_many(
        [(ChunkKey(bytes([i]) * 16), rng.integers(0, 256, sum(parts), dtype=np.uint8))
         for i in range(3)]))
    tier.close()
    good = json.loads(run("inspect", server.url, "--json").stdout)["namespaces"][0]
    assert good["chunks"] == 3 and good["bad"] == 0 and good["value_bytes"] == 3 * (128 + 48 + 16384)
    name = next(iter(server.client().scan_iter(match="kvtier:*")))
    value = bytearray(server.client().get(name))
    value[128 + 48 + 4096 + 7] ^= 1  # the middle part
    server.client().set(name, bytes(value))
    result = run("inspect", server.url, "--json")
    assert result.returncode == 1 and json.loads(result.stdout)["namespaces"][0]["bad"] == 1


def test_inspect_of_a_slow_store_ends_at_its_timeout_with_what_it_saw(server):
    """A store that drips its answers (512 bytes every 0.2 s) would hold an inspection for
    as long as its values take at that pace; --timeout bounds the whole of it."""
    fill(server, "m", 32).close()
    slow = DripProxy(server.port, lifetime=40)
    try:
        started = time.monotonic()
        result = run("inspect", slow.url, "--timeout", "4", "--json")
        assert time.monotonic() - started < 15  # 4 s, and the process's start
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["cut_short"] and not data["server"]
        assert [h["chunks"] for h in data["namespaces"]] == [32]  # listed before the timeout
        table = run("inspect", slow.url, "--timeout", "3")  # (its first answer in 0.2 s,
        # given 3: a loaded machine has taken more than 1 s to it; the whole takes minutes)
        assert table.returncode == 0 and "cut short at --timeout 3 s" in table.stdout
    finally:
        slow.stop()


def test_inspect_of_a_store_that_never_answers_fails_rather_than_showing_it_empty():
    with socket.socket() as silent:  # takes connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        port = silent.getsockname()[1]
        result = run("inspect", f"redis://127.0.0.1:{port}/0", "--timeout", "1")
    assert result.returncode == 2, result.stdout
    assert "no answer within --timeout 1 s" in result.stderr
    assert "no kvtier chunks" not in result.stdout


def test_inspect_of_a_store_wanting_a_password_names_the_variables_to_set(tmp_path):
    srv = RedisServer(tmp_path / "redis", "--requirepass", "s3cret").start()
    try:
        result = run("inspect", srv.url)
    finally:
        srv.stop()
    assert result.returncode == 2 and "KVTIER_REMOTE_PASSWORD" in result.stderr
    assert "s3cret" not in result.stderr


def test_inspect_runs_as_the_acl_user_docs_remote_md_gives(server):
    """The documented ACL grants no PING: a refusal is an answer, not a store that is down."""
    import re
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "remote.md").read_text()
    rules = re.findall(r"^\s+user kvtier on >secret (.+)$", docs, re.MULTILINE)[0].split()
    server.client().execute_command("ACL", "SETUSER", "kvtier", "reset", "on", ">secret", *rules)
    fill(server, "m", 2).close()
    result = run("inspect", server.url, "--json",
                 env={"KVTIER_REMOTE_USERNAME": "kvtier", "KVTIER_REMOTE_PASSWORD": "secret"})
    assert result.returncode == 0, result.stderr
    assert [h["chunks"] for h in json.loads(result.stdout)["namespaces"]] == [2]
