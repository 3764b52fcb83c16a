"""The remote store's chunks in every engine's KV events on Mooncake Store, against a real
mooncake_master and holder inside a private network namespace (tests/test_remote_mooncake.py
runs this module there): an engine that writes chunks appends their token records to the
store's log (``kvtier/remote/mooncake_log.py``); another engine, which never saw a request
for them, publishes them with vLLM's hashes, as held REMOTE, and as removed once the store
lost them. ``tests/test_connector_remote_events.py`` has the rest, on Valkey/Redis."""


import pytest

from kvtier.connector.scheduler import remote_events
from tests.helpers.mooncake_server import MooncakeServer, inside_namespace

if not inside_namespace():
    pytest.skip("runs only inside a private network namespace: tests/test_remote_mooncake.py "
                "starts it there", allow_module_level=True)

from tests.helpers.recorded_events import HASHING, Recorded, events_until
from tests.helpers.remote_engine import Engine
from tests.helpers.scheduler_side import BLOCK, CHUNK
from tests.helpers.vllm_requests import vllm_chain, vllm_request

TOKENS = list(range(7000, 7000 + 2 * CHUNK))


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setattr(remote_events, "FOLLOW_EVERY_S", 0.05)
    monkeypatch.setattr(remote_events, "CHECK_EVERY_S", 0.3)
    srv = MooncakeServer(tmp_path / "mooncake").start()
    yield srv
    srv.stop()


def test_another_engine_publishes_the_chunks_one_wrote_until_the_store_loses_them(server):
    a = Engine(server, hashing=HASHING)
    b = Engine(server, events=Recorded(), hashing=HASHING)
    try:
        assert b.scheduler.take_events() == []  # starts following the log
        a.store(vllm_request("r", TOKENS, BLOCK), [1, 2, 3, 4])
        assert a.scheduler.counters["remote_written_chunks"] == 2
        a.step()  # the records of the chunks written go to the store's log
        got = events_until(b, 2)
        hashes = vllm_chain(TOKENS, BLOCK)
        assert sorted(got) == sorted([
            ("stored", "STORAGE", tuple(hashes[0:2]), TOKENS[:CHUNK], True),
            ("stored", "STORAGE", tuple(hashes[2:4]), TOKENS[CHUNK:], True)])
        assert server.client().remove_by_regex("^kvtier:[0-9a-f]+:", True) == 2  # not the log
        gone = events_until(b, 2)
        assert sorted(e[:3] + e[4:] for e in gone) == sorted([
            ("removed", "STORAGE", tuple(hashes[0:2]), True),
            ("removed", "STORAGE", tuple(hashes[2:4]), True)])
    finally:
        a.close()
        b.close()
