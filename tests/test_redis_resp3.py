"""The Valkey/Redis tier on RESP3 (``?protocol=3``): every kind of round trip on a real
redis-server and a real one-node cluster, as an ACL user; and against a store that sends
maintenance notifications (``tests/helpers/resp_server.py``), which the tier never turns
on: redis-py 8 turned them on by itself on RESP3, and the store's pushes then came among
the replies read by hand, failing every read as an unexpected reply."""

import numpy as np
import pytest

from kvtier.remote.redis_tier import PASSWORD_ENV, USER_ENV, RedisTier
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.redis_setup import NS, chunk, key, wait_cluster
from tests.helpers.resp_server import RespServer

RAW = 16 * 1024
ACL = ("~kvtier:*", "+get", "+getrange", "+set", "+exists", "+unlink", "+xadd", "+xrange",
       "+strlen", "+scan", "+info", "+cluster|slots", "+cluster|shards", "+command")


def every_round_trip(tier: RedisTier) -> dict[str, bool]:
    """Each kind of round trip, answering whether it came back as it should."""
    into = [np.zeros(RAW, np.uint8) for _ in range(3)]
    return {
        "put": all(r.ok for r in tier.put_many([(key(i), chunk(i, RAW)) for i in range(2)])),
        "get": [r.ok for r in tier.get_many([key(0), key(1), key(9)], into)] == [True, True, False]
        and all(np.array_equal(into[i], chunk(i, RAW)) for i in range(2)),
        "parts": [r.ok for r in tier.get_parts([key(0), key(9)], into[:2], [(1,), (1,)])]
        == [True, False],
        "exists": tier.exists_answered([key(0), key(9)]) == [True, False],
        "append": tier.append_records([(key(0), b"record")]),
        "read": (tier.read_records(b"0", 8) or (b"", []))[1] == [(bytes(key(0)), b"record")],
        "remove": tier.remove([key(1)]) and tier.exists_answered([key(1)]) == [False],
        "in service": tier.failures == 0 and not tier.down,
    }


@needs_redis
@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_every_round_trip_on_resp3_as_an_acl_user(tmp_path, cluster):
    server = RedisServer(tmp_path / "redis", *(("--cluster-enabled", "yes", "--cluster-config-file",
                                                "nodes.conf") if cluster else ())).start()
    try:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "kvtier", "on", ">secret", *ACL)
        if cluster:
            admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            wait_cluster(server)
        scheme = "redis+cluster" if cluster else "redis"
        tier = RedisTier(f"{scheme}://127.0.0.1:{server.port}?protocol=3", NS, RAW,
                         timeout_s=5.0, retry_s=60.0, parts=(RAW // 2, RAW // 2),
                         environ={USER_ENV: "kvtier", PASSWORD_ENV: "secret"})
        try:
            answers = every_round_trip(tier)
            assert all(answers.values()), answers
        finally:
            tier.close()
    finally:
        server.stop()


def test_a_store_sending_maintenance_notifications_sends_the_tier_none():
    """(every GET and GETRANGE round trip failed on the push that came before its reply,
    the tier out of service; the commands redis-py reads went through)"""
    server = RespServer()
    try:
        tier = RedisTier(server.url("protocol=3"), NS, RAW, timeout_s=5.0, retry_s=60.0,
                         parts=(RAW // 2, RAW // 2))
        try:
            assert tier.put_many([(key(0), chunk(0, RAW))])[0].ok
            into = np.zeros(RAW, np.uint8)
            got = tier.get_many([key(0)], [into])[0]
            assert got.ok and np.array_equal(into, chunk(0, RAW)), got
            assert tier.get_parts([key(0)], [into], [(1,)])[0].ok
            assert tier.exists_answered([key(0)]) == [True]
            assert tier.failures == 0 and not tier.down
            assert server.notified == 0 and server.pushes == 0
        finally:
            tier.close()
    finally:
        server.stop()
