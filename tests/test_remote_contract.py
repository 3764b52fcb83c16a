"""The remote tier's contract (``kvtier/remote/base.py``), one suite
(``tests/helpers/remote_contract.py``) run on each Valkey/Redis store here: one redis-server
and a cluster of three, on loopback. Mooncake Store runs the same suite inside a private
network namespace (``tests/mooncake_inner_contract.py``, started by
``tests/test_remote_mooncake.py``)."""

import pytest

from tests.helpers.redis_server import needs_redis
from tests.helpers.remote_contract import RemoteContract
from tests.helpers.remote_stores import RedisClusterStore, RedisStore

pytestmark = needs_redis


class TestRedisServer(RemoteContract):
    @pytest.fixture(scope="class")
    @classmethod
    def shared_store(cls, tmp_path_factory):
        store = RedisStore(tmp_path_factory.mktemp("contract") / "redis")
        yield store
        store.close()


class TestRedisCluster(RemoteContract):
    @pytest.fixture(scope="class")
    @classmethod
    def shared_store(cls, tmp_path_factory):
        store = RedisClusterStore(tmp_path_factory.mktemp("contract") / "cluster")
        yield store
        store.close()
