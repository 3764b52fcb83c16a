"""A Valkey/Redis store loading its data (restarted with persistence on, a replica's full
sync) answers every command ``LOADING`` until it is done, against a stand-in store that
answers so (``tests/helpers/resp_server.py``; a real redis-server answers so through a
``DEBUG RELOAD`` of a large dataset): every kind of round trip fails, as redis-py fails
the commands it reads, and the tier is out of service for ``remote_retry``, its going and
its coming back once the store is done logged once each."""

import logging
import time

import numpy as np

from kvtier.io.result import IOStatus
from kvtier.remote.redis_tier import RedisTier
from tests.helpers.redis_setup import NS, chunk, key
from tests.helpers.resp_server import RespServer

RAW = 16 * 1024
RETRY_S = 0.2


def test_a_store_loading_its_data_takes_the_tier_out_of_service_until_it_is_done(caplog):
    """(a GET or GETRANGE answered LOADING was a round trip that worked: the tier, out of
    service since a lookup's LOADING, logged itself back in service, then out again at
    the next lookup, every ``remote_retry`` for as long as the store loaded)"""
    caplog.set_level(logging.INFO, logger="kvtier")
    server = RespServer()
    tier = RedisTier(server.url("protocol=2"), NS, RAW, timeout_s=5.0, retry_s=RETRY_S,
                     parts=(RAW // 2, RAW // 2))
    try:
        into = np.zeros(RAW, np.uint8)
        assert tier.put_many([(key(0), chunk(0, RAW))])[0].ok
        server.loading = True
        calls = {"get": lambda: tier.get_many([key(0)], [into])[0],
                 "parts": lambda: tier.get_parts([key(0)], [into], [(1,)])[0],
                 "exists": lambda: tier.exists_answered([key(0)]),
                 "read": lambda: tier.read_records(b"0", 8)}
        for round_ in range(2):
            for what, call in calls.items():
                time.sleep(RETRY_S * 1.5)  # past remote_retry: the store is asked
                failures = tier.failures
                answer = call()
                assert answer is None or answer.status is IOStatus.IO_ERROR, (what, answer)
                if what != "read":  # (a failed read of the log takes nothing out of service)
                    assert tier.down and tier.failures == failures + 1, (what, round_)
        server.loading = False
        time.sleep(RETRY_S * 1.5)
        assert tier.get_many([key(0)], [into])[0].ok and np.array_equal(into, chunk(0, RAW))
        logged = [r.getMessage() for r in caplog.records if "remote tier" in r.getMessage()]
        assert sum("out of service" in m for m in logged) == 1, logged
        assert sum("back in service" in m for m in logged) == 1, logged
    finally:
        tier.close()
        server.stop()
