"""The Valkey/Redis remote tier against a real redis-server on loopback, in what is Redis's
own: a store full under ``noeviction`` refuses puts as NO_SPACE, credentials come from the
environment only, and a put larger than the socket buffers to a store hung or dead fails in
time. What every backend promises is tests/test_remote_contract.py's."""

import os
import signal
import time

import numpy as np
import pytest

from kvtier.io.result import IOStatus
from kvtier.remote.redis_tier import PASSWORD_ENV, RedisTier, check_url
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.redis_setup import NS, RAW, chunk, key, running

pytestmark = needs_redis


@pytest.fixture
def server(tmp_path):
    with running(RedisServer(tmp_path / "redis")) as srv:
        yield srv


def tier(server, namespace=NS, **options) -> RedisTier:
    return RedisTier(server.url, namespace, RAW, **{"timeout_s": 1.0, "retry_s": 0.3, **options})


def test_a_full_store_refuses_puts_as_no_space(tmp_path):
    with running(RedisServer(tmp_path / "redis", "--maxmemory", "2mb",
                             "--maxmemory-policy", "noeviction")) as srv:
        t = tier(srv)
        statuses = [r.status for i in range(64) for r in t.put_many([(key(i), chunk(i))])]
        assert IOStatus.NO_SPACE in statuses and not t.down  # the store is up, only full


def test_credentials_come_from_the_environment_only(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=PASSWORD_ENV):
        check_url("redis://user:secret@127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="scheme"):
        check_url("http://127.0.0.1:6379")
    with running(RedisServer(tmp_path / "redis", "--requirepass", "s3cret")) as srv:
        denied = tier(srv)
        assert denied.put_many([(key(1), chunk(1))])[0].status is IOStatus.IO_ERROR
        allowed = RedisTier(srv.url, NS, RAW, environ={PASSWORD_ENV: "s3cret"})
        assert allowed.put_many([(key(1), chunk(1))])[0].ok
        assert "s3cret" not in allowed.describe()
    assert os.environ.get(PASSWORD_ENV) is None


def test_a_put_to_a_store_that_died_is_a_failure_and_a_hung_one_times_out(server):
    big = np.zeros(64 * 2**20, np.uint8)  # more than the socket buffers take
    patient = RedisTier(server.url, NS, big.nbytes, timeout_s=10, retry_s=0.3)  # a busy machine
    assert patient.put_many([(key(1), big)])[0].ok
    assert patient.put_many([(key(1), chunk(1))])[0].status is IOStatus.IO_ERROR  # not a chunk's size
    t = RedisTier(server.url, NS, big.nbytes, timeout_s=0.3, retry_s=0.3)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        assert t.put_many([(key(2), big)])[0].status is IOStatus.TIMED_OUT
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    server.stop()
    time.sleep(0.35)
    assert t.put_many([(key(3), big)])[0].status is IOStatus.IO_ERROR
