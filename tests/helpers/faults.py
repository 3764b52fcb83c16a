"""Faults: a store reopened over chunks on disk, where a chunk's slot is and a byte of a file
flipped in place; and a load that checks every byte while a remote store fails."""

import threading
import time

import numpy as np
import torch

from kvtier import KVStore
from kvtier.disk import tier as disk_module
from tests.helpers.kv import CHUNK, SMALL, bookkeeping, make_kv, same_bytes
from tests.helpers.store import config, seq


def stored(path, chunks=6, **extra):
    """A store on ``path`` holding ``chunks`` chunks of seq(0) on disk, then reopened."""
    tokens = seq(0, chunks)
    with KVStore(SMALL, config(path, **extra)) as store:
        store.put(tokens, make_kv(tokens))
        store.flush()
        assert store.stats().disk_writes == chunks
    return KVStore(SMALL, config(path, **extra)), tokens


def slot_of(store, tokens, i):
    with bookkeeping(store) as stack:
        return stack.indexes[disk_module.TierName.DISK].slot_of(store.keys(tokens)[i])


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


# -- a remote store failing under load ----------------------------------------------------

PROMPTS = [np.random.default_rng(i).integers(0, 30000, 4 * CHUNK).tolist() for i in range(24)]
HANG_BOUND_S = 20.0  # far above remote_timeout: a call this slow means something blocked


class Load:
    """Threads putting and getting PROMPTS on stores until stopped, checking every byte."""

    def __init__(self, stores: list[KVStore], threads_each: int = 2) -> None:
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.gets = self.served = self.wrong = 0
        self.slowest = 0.0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(s, 1000 * i + j))
                         for i, s in enumerate(stores) for j in range(threads_each)]

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        assert not any(t.is_alive() for t in self._threads), "a load thread never returned"

    def _run(self, s: KVStore, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not self.stop.is_set():
            toks = PROMPTS[int(rng.integers(len(PROMPTS)))]
            started = time.monotonic()
            try:
                if rng.random() < 0.4:
                    s.put(toks, make_kv(toks))
                    n, ok = 0, True
                else:
                    out = torch.zeros_like(make_kv(toks))
                    n = s.get(toks, out)
                    ok = same_bytes(out[:, :, :n], make_kv(toks)[:, :, :n])
            except Exception as exc:  # a call that raised: the test fails
                with self._lock:
                    self.errors.append(repr(exc))
                continue
            with self._lock:
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.gets += 1
                self.served += n
                self.wrong += not ok


def check(load: Load) -> None:
    assert load.errors == []
    assert load.wrong == 0
    assert load.slowest < HANG_BOUND_S
    assert load.gets > 0
