"""The Redis remote tier on a cluster, against real redis-servers on loopback, in what is a
cluster's own (what every backend promises is tests/test_remote_contract.py's): chunks
spread over the nodes by slot, a hung node costing its own keys only, one client
set-up at a time (the callers that waited on a failed one do not repeat it), TLS options
of a ``rediss+cluster://`` URL reach every node's connection, and the ACL docs/remote.md
gives runs a cluster tier (a missing permission is named in the failure)."""

import logging
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.io.result import IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.redis_tier import PASSWORD_ENV, USER_ENV, RedisTier
from tests.helpers.redis_server import RedisServer, needs_redis

pytestmark = needs_redis
RAW = 4096
NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "remote.md"


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, RAW, dtype=np.uint8)


def one_node_cluster(workdir: Path, tls: dict[str, str] | None = None) -> RedisServer:
    """A cluster of one primary holding every slot (TLS only, on its port, with ``tls``)."""
    server = RedisServer(workdir, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
    if tls:
        server.extra += ("--port", "0", "--tls-port", str(server.port), "--tls-cluster", "yes",
                         "--tls-cert-file", tls["cert"], "--tls-key-file", tls["key"],
                         "--tls-ca-cert-file", tls["ca"], "--tls-auth-clients", "yes")
    server.start()
    import redis

    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5, **(
        {"ssl": True, "ssl_ca_certs": tls["ca"], "ssl_certfile": tls["cert"],
         "ssl_keyfile": tls["key"]} if tls else {}))
    client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    deadline = time.monotonic() + 30
    while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
        assert time.monotonic() < deadline, "the one-node cluster never came up"
        time.sleep(0.05)
    client.close()
    return server


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> dict[str, str]:
    """A CA, and a certificate it signed for 127.0.0.1 (the server's and the client's)."""
    root = tmp_path_factory.mktemp("tls")
    ca, ca_key, cert, cert_key = (str(root / n) for n in ("ca.pem", "ca.key", "cert.pem", "cert.key"))
    (root / "ext").write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
            "-days", "2", "-subj", "/CN=kvtier test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", cert_key, "-out",
            str(root / "cert.csr"), "-subj", "/CN=127.0.0.1")
    openssl("x509", "-req", "-in", str(root / "cert.csr"), "-CA", ca, "-CAkey", ca_key,
            "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", str(root / "ext"))
    return {"ca": ca, "cert": cert, "key": cert_key}


def test_callers_that_waited_on_a_failed_cluster_setup_do_not_set_it_up_again(tmp_path):
    server = RedisServer(tmp_path / "hung").start()  # hung: it never answers the slot map
    tier = RedisTier(f"redis+cluster://127.0.0.1:{server.port}", NS, RAW, timeout_s=1.0,
                     retry_s=60)
    took: list[float] = []

    def call(i: int) -> None:
        started = time.monotonic()
        tier.exists([key(i)])
        took.append(time.monotonic() - started)

    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        callers = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(timeout=60)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()
    assert len(took) == 6 and tier.failures == 1  # one set-up tried, the others out of service
    assert max(took) < 4.0, took  # one set-up's timeout, not six (6 s)
    tier.close()


def test_a_tls_cluster_gets_the_ca_and_client_certificate_the_url_names(tmp_path, certificates):
    server = one_node_cluster(tmp_path / "tls", certificates)
    query = (f"ssl_ca_certs={certificates['ca']}&ssl_certfile={certificates['cert']}"
             f"&ssl_keyfile={certificates['key']}")
    try:
        for url in (f"rediss+cluster://127.0.0.1:{server.port}?{query}",
                    f"rediss://127.0.0.1:{server.port}/0?{query}"):
            tier = RedisTier(url, NS, RAW, timeout_s=5.0, retry_s=0.1)
            assert all(r.ok for r in tier.put_many([(key(i), chunk(i)) for i in range(4)])), url
            dsts = [np.zeros(RAW, np.uint8) for _ in range(4)]
            assert all(r.ok for r in tier.get_many([key(i) for i in range(4)], dsts))
            assert all(np.array_equal(dsts[i], chunk(i)) for i in range(4))
            assert certificates["ca"] not in tier.describe()  # query values are not shown
            tier.close()
    finally:
        server.stop()


def documented_acl(which: str) -> list[str]:
    """The ACL rules docs/remote.md gives for ``which`` ("server" or "cluster")."""
    rules = re.findall(r"^\s+user kvtier on >secret (.+)$", DOCS.read_text(), re.MULTILINE)
    assert len(rules) == 2, "docs/remote.md gives one ACL for a server, one for a cluster"
    return rules[0 if which == "server" else 1].split()


def test_the_documented_acls_run_a_tier_and_a_missing_permission_is_named(tmp_path, caplog):
    cluster = one_node_cluster(tmp_path / "acl")
    single = RedisServer(tmp_path / "single").start()
    env = {USER_ENV: "kvtier", PASSWORD_ENV: "secret"}
    try:
        def put(server: RedisServer, url: str, rules: list[str]):
            server.client().execute_command("ACL", "SETUSER", "kvtier", "reset", "on", ">secret",
                                            *rules)
            tier = RedisTier(url, NS, RAW, timeout_s=5.0, retry_s=0.1, environ=env)
            try:
                (result,) = tier.put_many([(key(1), chunk(1))])
                if result.ok:
                    (got,) = tier.get_many([key(1)], [np.zeros(RAW, np.uint8)])
                    assert got.ok and tier.exists([key(1)]) == [True]
                return result
            finally:
                tier.close()

        cluster_url = f"redis+cluster://127.0.0.1:{cluster.port}"
        assert put(single, single.url, documented_acl("server")).ok
        assert put(cluster, cluster_url, documented_acl("cluster")).ok
        server_only = [r for r in documented_acl("cluster") if r.startswith(("~", "+get", "+set",
                       "+exists", "+strlen", "+scan", "+info"))]
        without_slots = put(cluster, cluster_url, server_only)
        assert without_slots.status is IOStatus.IO_ERROR and "+cluster|slots" in without_slots.detail
        without_command = put(cluster, cluster_url, [*server_only, "+cluster|slots"])
        assert without_command.status is IOStatus.IO_ERROR
        assert "grant the ACL user" in without_command.detail and "+command" in without_command.detail
        assert "+command" in caplog.text  # the warning of the outage names it too
    finally:
        cluster.stop()
        single.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three primaries that do not fail a node paused for less than a minute."""
    from tests.helpers.redis_server import RedisCluster

    started = RedisCluster(tmp_path_factory.mktemp("cluster"), node_timeout_ms=60000).start()
    yield started
    started.stop()


def filled_tier(cluster, keys: list[ChunkKey], timeout_s: float = 1.0,
                retry_s: float = 2.0) -> RedisTier:
    """A tier on ``cluster`` (deadline 1 s, retry after 2 s) that holds ``keys``, spread by
    slot over every node."""
    tier = RedisTier(cluster.url, NS, RAW, timeout_s=timeout_s, retry_s=retry_s,
                     parts=(RAW // 2, RAW // 2))
    for _ in range(10):  # on a loaded machine a first connection may take over the deadline
        if all(r.ok for r in tier.put_many([(k, chunk(i)) for i, k in enumerate(keys)])):
            break
        time.sleep(retry_s + 0.1)
    held = [node.client().dbsize() for node in cluster.nodes]
    assert sum(held) >= len(keys) and all(h > 0 for h in held), held
    return tier


def holder(cluster, k: ChunkKey):
    """The node serving ``k``'s slot."""
    from redis.crc import key_slot

    from kvtier.remote.values import value_key

    slot = key_slot(value_key("kvtier:", NS.digest(), k))
    ranges = cluster.nodes[0].client().execute_command("CLUSTER", "SLOTS")
    port = next(r[2][1] for r in ranges if r[0] <= slot <= r[1])
    return next(node for node in cluster.nodes if node.port == port)


def test_a_hung_node_costs_its_own_keys_and_the_others_nodes_are_served(cluster):
    """One node of three hung (SIGSTOP), the one asked first: the first round trip answers
    every other node's keys (read as they arrive, the hung one last) and fails the hung
    node's; the node goes out of service alone (the tier stays in), its keys answered at
    once without asking it until ``retry_s``; the slot map is asked for anew off the round
    trips; once the node answers again it is back."""
    keys = [key(i) for i in range(48)]
    tier = filled_tier(cluster, keys)
    victim = holder(cluster, keys[0])  # the node written to, and read, first
    on_victim = [holder(cluster, k) is victim for k in keys]
    assert 8 <= sum(on_victim) < len(keys)
    os.kill(victim.process.pid, signal.SIGSTOP)
    try:
        got = tier.get_many(keys, [np.zeros(RAW, np.uint8) for _ in keys])
        assert [r.ok for r in got] == [not v for v in on_victim]
        assert {r.status for r, v in zip(got, on_victim, strict=True) if v} == {IOStatus.TIMED_OUT}
        assert tier.failures == 0 and not tier.down
        assert tier.outages.names() == tier.nodes_out() == [f"127.0.0.1:{victim.port}"]
        parts = tier.get_parts(keys, [np.zeros(RAW, np.uint8) for _ in keys], [(1,)] * len(keys))
        assert [r.ok for r in parts] == [not v for v in on_victim]
        assert {r.status for r, v in zip(parts, on_victim, strict=True) if v} == {IOStatus.PATH_DOWN}
        assert tier.exists_answered(keys) == [None if v else True for v in on_victim]
        put = tier.put_many([(k, chunk(i)) for i, k in enumerate(keys)])
        assert [r.ok for r in put] == [not v for v in on_victim]
        assert tier.outages.failures == 1  # asked once: the round trips after did not wait on it
        assert tier.slot_map.wait(30) and tier.slot_map.refreshes >= 1
        assert tier.failures == 0 and not tier.down
        time.sleep(2.1)  # past retry_s: asked again, last; its connect (made anew) hangs
        got = tier.get_many(keys, [np.zeros(RAW, np.uint8) for _ in keys])
        assert [r.ok for r in got] == [not v for v in on_victim]
        assert tier.outages.failures == 2 and tier.failures == 0 and not tier.down
    finally:
        os.kill(victim.process.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while True:
        ok = [r.ok for r in tier.get_many(keys, [np.zeros(RAW, np.uint8) for _ in keys])]
        if any(o and v for o, v in zip(ok, on_victim, strict=True)):
            break
        assert time.monotonic() < deadline, "the node never came back"
        time.sleep(0.2)
    assert all(ok)  # its trial asked for every one of its keys, not only the first
    assert tier.outages.names() == [] and tier.exists(keys) == [True] * len(keys)
    tier.close()


def pooled_sockets(tier: RedisTier, port: int) -> set[int]:
    """The sockets of the connections the tier's client keeps pooled for the node at ``port``."""
    node = tier._client.get_node(host="127.0.0.1", port=port)
    pool = tier._client.get_redis_connection(node).connection_pool
    return {id(c._sock) for c in pool._available_connections if c._sock is not None}


def test_a_node_hung_while_written_costs_its_keys_and_keeps_the_other_nodes_connections(cluster):
    """The node written first stops (SIGSTOP) with a write of 16 MiB to it under way: its
    send runs out the round trip's deadline. The nodes whose turn came after it fail their
    keys, are not taken out, and their pooled connections stay as they were (none taken,
    so none dropped); the next round trip serves them on those connections."""
    raw = 1 << 20
    keys = [key(300 + i) for i in range(48)]
    victim = holder(cluster, keys[0])
    data = [(k, np.full(raw, i, np.uint8)) for i, k in enumerate(keys)]
    on_victim = [holder(cluster, k) is victim for k in keys]
    assert sum(on_victim) >= 8  # 8 MiB or more: past what a stopped node's sockets take
    tier = RedisTier(cluster.url, NS, raw, timeout_s=1.0, retry_s=60)
    try:
        for _ in range(10):  # on a loaded machine a first connection may take over the deadline
            if all(r.ok for r in tier.put_many(data)):
                break
        others = [n.port for n in cluster.nodes if n is not victim]
        before = {port: pooled_sockets(tier, port) for port in others}
        assert all(before.values())
        os.kill(victim.process.pid, signal.SIGSTOP)
        try:
            put = tier.put_many(data)
            assert not any(r.ok for r in put)
            assert {r.status for r in put} == {IOStatus.TIMED_OUT}
            assert tier.outages.names() == [f"127.0.0.1:{victim.port}"] and not tier.down
            assert {port: pooled_sockets(tier, port) for port in others} == before
            again = tier.put_many(data)
            assert [r.ok for r in again] == [not v for v in on_victim]
        finally:
            os.kill(victim.process.pid, signal.SIGCONT)
    finally:
        tier.close()


def test_round_trips_at_once_after_retry_s_leave_the_hung_nodes_trial_to_one(cluster):
    """A node still hung once its ``retry_s`` is over: of six round trips that start
    together, one asks it (its trial) and waits out the deadline; the others answer its keys
    at once and serve every other node's, and the node fails once more, not six times."""
    keys = [key(500 + i) for i in range(24)]
    tier = filled_tier(cluster, keys)
    victim = holder(cluster, keys[0])
    on_victim = [holder(cluster, k) is victim for k in keys]
    os.kill(victim.process.pid, signal.SIGSTOP)
    try:
        tier.get_many(keys, [np.zeros(RAW, np.uint8) for _ in keys])
        assert tier.outages.failures == 1
        time.sleep(2.1)  # past retry_s
        start, results = threading.Barrier(6), []

        def look() -> None:
            start.wait()
            results.append([r.ok for r in tier.get_many(keys, [np.zeros(RAW, np.uint8) for _ in keys])])

        threads = [threading.Thread(target=look) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert results == [[not v for v in on_victim]] * 6
        assert tier.outages.failures == 2 and not tier.down
    finally:
        os.kill(victim.process.pid, signal.SIGCONT)
        tier.close()


def test_a_redis_url_naming_a_cluster_node_says_to_name_it_as_a_cluster(cluster, caplog):
    """``redis://`` naming one node of a cluster: the keys of its own slots are served, the
    others are misses (redirected), and a warning says, once, to use ``redis+cluster://``."""
    caplog.set_level(logging.WARNING, logger="kvtier")
    node = cluster.nodes[0]
    tier = RedisTier(node.url, NS, RAW, timeout_s=5.0, retry_s=60)
    keys = [key(200 + i) for i in range(24)]
    try:
        mine = [holder(cluster, k) is node for k in keys]
        assert any(mine) and not all(mine)
        for _ in range(2):
            put = tier.put_many([(k, chunk(i)) for i, k in enumerate(keys)])
            assert [r.ok for r in put] == mine
        said = [r.getMessage() for r in caplog.records if "redis+cluster://" in r.getMessage()]
        assert len(said) == 1 and "a node of a Redis cluster" in said[0], said
        assert not tier.down and tier.failures == 0
    finally:
        tier.close()


def test_a_cluster_whose_every_node_is_hung_takes_the_tier_out(cluster):
    """Every primary hung: a read of the log of token records fails (a hint: no node taken
    out); a round trip fails as a whole once every node of the map is out of service (the
    tier out, as one server's would be), and comes back after."""
    keys = [key(100 + i) for i in range(24)]
    tier = filled_tier(cluster, keys)
    assert tier.read_records(b"0", 16) is not None
    for node in cluster.nodes:
        os.kill(node.process.pid, signal.SIGSTOP)
    try:
        assert tier.read_records(b"0", 16) is None  # a hint: its failure takes no node out
        assert tier.outages.names() == [] and not tier.down and tier.failures == 0
        got = tier.get_many(keys, [np.zeros(RAW, np.uint8) for _ in keys])
        assert not any(r.ok for r in got)
        assert tier.failures == 1 and tier.down
        assert sorted(tier.outages.names()) == sorted(f"127.0.0.1:{n.port}" for n in cluster.nodes)
    finally:
        for node in cluster.nodes:
            os.kill(node.process.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while not all(r.ok for r in tier.get_many(keys, [np.zeros(RAW, np.uint8) for _ in keys])):
        assert time.monotonic() < deadline, "the tier never came back"
        time.sleep(0.2)
    tier.close()


def test_after_the_whole_cluster_was_out_a_node_still_hung_costs_its_own_keys(cluster):
    """Every primary hung (the tier out), then all but one answer again: the one still hung
    is the URL's node, which holds slot 0 (redis-py asks it first for the slot map, or for
    its commands). Once ``retry_s`` has passed the other nodes' keys are served: the client
    is kept (a client made anew in a round trip would spend its deadline on that node, and
    fail it for every node), and the hung node's keys are misses."""
    keys = [key(400 + i) for i in range(24)]
    tier = filled_tier(cluster, keys)
    hung = cluster.nodes[0]
    assert cluster.url.endswith(f":{hung.port}") and holder(cluster, key(400)) is not None
    on_hung = [holder(cluster, k) is hung for k in keys]
    assert any(on_hung) and not all(on_hung)
    for node in cluster.nodes:
        os.kill(node.process.pid, signal.SIGSTOP)
    try:
        assert not any(r.ok for r in tier.get_many(keys, [np.zeros(RAW, np.uint8) for _ in keys]))
        assert tier.down
        for node in cluster.nodes[1:]:
            os.kill(node.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while True:
            got = [r.ok for r in tier.get_many(keys, [np.zeros(RAW, np.uint8) for _ in keys])]
            assert not any(ok and h for ok, h in zip(got, on_hung, strict=True))
            if got == [not h for h in on_hung]:
                break
            assert time.monotonic() < deadline, "the other nodes' keys were never served again"
            time.sleep(0.2)
        assert not tier.down and tier.outages.names() == [f"127.0.0.1:{hung.port}"]
    finally:
        for node in cluster.nodes:
            os.kill(node.process.pid, signal.SIGCONT)
        tier.close()


def test_a_slot_moved_under_load_is_a_miss_of_its_key_and_fails_no_other_round_trip(tmp_path):
    """A resharding moves a slot while another thread reads: the lookup redirected (MOVED)
    answers nothing for its key, the slot map is asked for anew in place, and no round trip
    of the other thread fails (closing the shared client would cut them: the tier out of
    service for ``remote_retry``)."""
    from redis.crc import key_slot

    from kvtier.remote.values import value_key
    from tests.helpers.redis_server import RedisCluster

    cluster = RedisCluster(tmp_path / "cluster").start()
    tier = RedisTier(cluster.url, NS, RAW, timeout_s=5.0, retry_s=30)
    try:
        keys = [key(i) for i in range(12)]
        assert all(r.ok for r in tier.put_many([(k, chunk(i)) for i, k in enumerate(keys)]))
        used = {key_slot(value_key("kvtier:", NS.digest(), k)) for k in keys}
        probe = next(key(1000 + i) for i in range(10000)  # a slot no chunk uses
                     if key_slot(value_key("kvtier:", NS.digest(), key(1000 + i))) not in used)
        slot = key_slot(value_key("kvtier:", NS.digest(), probe))
        assert tier.exists_answered([probe]) == [False]
        clients = {node.port: node.client() for node in cluster.nodes}
        ids = {port: c.execute_command("CLUSTER", "MYID").decode() for port, c in clients.items()}
        owner = next(port for port, c in clients.items()
                     if any(s[0] <= slot <= s[1] and s[2][1] == port
                            for s in c.execute_command("CLUSTER", "SLOTS")))
        target = next(port for port in clients if port != owner)
        stop, statuses = threading.Event(), set()

        def reader() -> None:
            while not stop.is_set():
                got = tier.get_many(keys, [np.zeros(RAW, np.uint8) for _ in keys])
                statuses.update(r.status for r in got)

        thread = threading.Thread(target=reader)
        thread.start()
        time.sleep(0.3)
        for port in (target, owner, *[p for p in clients if p not in (owner, target)]):
            clients[port].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
        answers = [tier.exists_answered([probe]) for _ in range(10)]
        time.sleep(0.3)
        stop.set()
        thread.join(30)
        assert [None] in answers or answers[0] == [False]  # redirected, or the map was fresh
        assert tier.slot_map.wait(30)  # the map asked for anew, off the round trips
        assert tier.exists_answered([probe]) == [False]  # answered by the new owner
        assert tier.failures == 0 and not tier.down and statuses == {IOStatus.OK}
    finally:
        tier.close()
        cluster.stop()


def test_a_cluster_option_the_installed_redis_py_would_drop_fails_the_start(tmp_path, monkeypatch):
    """redis-py before 7.4 keeps only the options it knows for a cluster's nodes and drops
    the rest (``ssl_ca_path``): a tier asked for one fails its start, naming it and the
    release that keeps it, rather than connect without it."""
    import redis.cluster

    monkeypatch.setattr(redis.cluster, "REDIS_ALLOWED_KEYS",
                        tuple(k for k in redis.cluster.REDIS_ALLOWED_KEYS if k != "ssl_ca_path"))
    url = f"rediss+cluster://127.0.0.1:6379?ssl_ca_path={tmp_path}"
    with pytest.raises(ValueError, match=r"ssl_ca_path: redis-py .* drops it .* 7\.4 or later"):
        RedisTier(url, NS, RAW)
    RedisTier(url.replace("+cluster", ""), NS, RAW).close()  # one server's client keeps it


def test_a_cluster_named_by_a_host_name_is_asked_by_that_name_again(cluster, monkeypatch):
    """Its slot map is asked of the URL's name, never of the addresses found behind it:
    a cluster replaced whole (a redeploy, a managed service's nodes replaced), its name
    moved to new addresses, is found there again. Before, redis-py swapped the name for
    the addresses its first slot map named, and the tier stayed out until a restart."""
    import socket

    from kvtier.remote import resolve

    def lookup(host, port, family, kind):  # the cluster's name, as a DNS server would say
        assert host == "kvcluster", host
        return socket.getaddrinfo("127.0.0.1", port, family, kind)

    monkeypatch.setattr(resolve.RESOLVER, "_lookup_fn", lookup)
    port = cluster.nodes[0].port
    tier = RedisTier(f"redis+cluster://kvcluster:{port}", NS, RAW, timeout_s=5.0, retry_s=0.1)
    try:
        assert tier.put_many([(key(500), chunk(500))])[0].ok
        assert sorted(tier._client.nodes_manager.startup_nodes) == [f"kvcluster:{port}"]
    finally:
        tier.close()


def test_a_cluster_whose_every_node_hangs_is_said_out_once_not_back_and_out_again(cluster, caplog):
    """Callers at once while every node hangs: one holds each node's trial, the others are
    answered at once without asking any node; that is no news of the store, and before it
    logged the tier back in service, then out again, every retry_s."""
    keys = [key(700 + i) for i in range(12)]
    tier = filled_tier(cluster, keys, timeout_s=0.3, retry_s=0.5)
    for node in cluster.nodes:
        os.kill(node.process.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.INFO, logger="kvtier"):
            until = time.monotonic() + 3.0

            def look() -> None:
                while time.monotonic() < until:
                    tier.exists_answered(keys)
                    time.sleep(0.01)

            callers = [threading.Thread(target=look) for _ in range(4)]
            for caller in callers:
                caller.start()
            for caller in callers:
                caller.join()
        said = [r.getMessage() for r in caplog.records if "cluster node" not in r.getMessage()]
        assert not [m for m in said if "back in service" in m], said
    finally:
        for node in cluster.nodes:
            os.kill(node.process.pid, signal.SIGCONT)
        tier.close()


def test_a_lookup_the_acl_refuses_is_said_once_naming_the_permission(tmp_path, caplog):
    """Without +exists every lookup is refused key by key: the tier stays in service (its
    reads and writes work), and said nothing before; its lookups stopped without a word."""
    single = RedisServer(tmp_path / "single").start()
    env = {USER_ENV: "kvtier", PASSWORD_ENV: "secret"}
    rules = [r for r in documented_acl("server") if r != "+exists"]
    assert len(rules) == len(documented_acl("server")) - 1
    try:
        single.client().execute_command("ACL", "SETUSER", "kvtier", "reset", "on", ">secret", *rules)
        tier = RedisTier(single.url, NS, RAW, timeout_s=5.0, retry_s=0.1, environ=env)
        try:
            assert tier.put_many([(key(1), chunk(1))])[0].ok
            with caplog.at_level(logging.WARNING, logger="kvtier"):
                assert tier.exists_answered([key(1)]) == [None]
                assert tier.exists_answered([key(1)]) == [None] and not tier.down
            said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
            assert len(said) == 1 and "+exists" in said[0], said
        finally:
            tier.close()
    finally:
        single.stop()
