"""``KVStore`` over a remote tier, through the public API: the store arm of the remote
benchmarks (``scripts/bench_remote.py``, ``scripts/bench_remote_mooncake.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.layout import KVLayout
from kvtier.store.kvstore import KVStore

LAYOUT = KVLayout(num_layers=2, kv_heads=8, head_size=128, dtype="bfloat16")  # 8 KiB a token


def store_bandwidth(url: str, chunk: int, count: int, batch: int, repeats: int,
                    clean: Callable[[], None] | None = None) -> tuple[float, float]:
    """GiB/s of ``KVStore.put`` + ``flush`` of ``count`` chunks of ``chunk`` bytes to the
    store at ``url`` (prompts of ``batch`` chunks), and of ``KVStore.get`` of them on a second
    store whose host memory holds half of them (another "node": every pass reads each chunk
    from the store). Each store first moves as many other chunks, untimed, so that the pass
    timed finds its host memory touched, as in a store that has been serving. Best of
    ``repeats``; every byte read is checked; ``clean`` (if given) empties the store after
    each round."""
    tokens = chunk // LAYOUT.token_bytes
    timed_prompts = [list(range(p * 10**6, p * 10**6 + batch * tokens)) for p in range(count // batch)]
    warm_prompts = [[t + 10**12 for t in prompt] for prompt in timed_prompts]
    passes = (warm_prompts, timed_prompts)  # the first pass touches host memory
    kv = torch.from_numpy(np.random.default_rng(0).integers(-2**15, 2**15, (
        LAYOUT.num_layers, 2, batch * tokens, LAYOUT.hidden), dtype=np.int16)).view(torch.bfloat16)
    config = {"chunk_tokens": tokens, "remote_url": url, "remote_timeout": "30s", "io_threads": 8}
    host = f"{count * chunk // 2**20 + 64}MiB"
    put_s, get_s = [], []
    for r in range(repeats):
        put_s.append(_put_seconds({**config, "host_capacity": host}, f"bench-{r}", passes, kv, count))
        half = f"{count * chunk // 2 // 2**20 + 1}MiB"
        get_s.append(_get_seconds({**config, "host_capacity": half}, f"bench-{r}", passes, kv, count))
        if clean is not None:
            clean()
    moved = count * chunk / 2**30
    return moved / min(put_s), moved / min(get_s)


def _put_seconds(config: dict, model: str, passes: Sequence[list[list[int]]], kv: torch.Tensor,
                 count: int) -> float:
    """Seconds of the last of ``passes`` (two of ``count`` chunks) of ``put`` + ``flush`` of
    ``kv`` to a store of ``config``; every write checked taken."""
    with KVStore(LAYOUT, config, model=model) as writer:
        for prompts in passes:
            start = time.perf_counter()
            for prompt in prompts:
                writer.put(prompt, kv)
            if not writer.flush(600):
                raise RuntimeError(f"the store did not take every write: {writer.stats()}")
        seconds = time.perf_counter() - start
        if writer.stats().remote_writes != 2 * count:
            raise RuntimeError(f"{writer.stats().remote_writes} writes, not {2 * count}")
    return seconds


def _get_seconds(config: dict, model: str, passes: Sequence[list[list[int]]], kv: torch.Tensor,
                 count: int) -> float:
    """Seconds of the last of ``passes`` (two of ``count`` chunks) of ``get`` from a store of
    ``config``; every chunk checked read from the remote store, and its bytes ``kv``'s."""
    with KVStore(LAYOUT, config, model=model) as reader:
        out = reader.empty_kv(kv.shape[2])
        for prompts in passes:
            start = time.perf_counter()
            for prompt in prompts:
                if reader.get(prompt, out) != len(prompt):
                    raise RuntimeError(f"a get missed: {reader.stats()}")
        seconds = time.perf_counter() - start
        if reader.stats().remote_reads != 2 * count:
            raise RuntimeError(f"{reader.stats().remote_reads} remote reads, not {2 * count}")
        if not torch.equal(out.view(torch.int16), kv.view(torch.int16)):
            raise RuntimeError("a get returned wrong bytes")
    return seconds
