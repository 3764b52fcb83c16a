"""A store with a disk tier as the store tests set it up: its config, token sequences of
whole chunks, and loads whose every byte is checked."""

import torch

from tests.helpers.kv import CHUNK, CHUNK_BYTES, SMALL, make_kv, same_bytes

STRIDE = 4096 + CHUNK_BYTES


def config(path, host_chunks=4, disk_chunks=64, **extra):
    return {"chunk_tokens": CHUNK, "host_capacity": host_chunks * CHUNK_BYTES,
            "disk_paths": [str(path)], "disk_capacity": disk_chunks * STRIDE,
            "disk_min_free": 0, "io_threads": 2, "model": "test-model", **extra}


def seq(start, chunks):
    return list(range(start, start + chunks * CHUNK))


def load(store, tokens, layout=SMALL):
    out = torch.zeros(layout.shape(len(tokens)), dtype=getattr(torch, layout.dtype))
    n = store.get(tokens, out)
    return n, out[:, :, :n]


def exact(store, tokens) -> int:
    """Load ``tokens`` and check every byte loaded; return the tokens loaded."""
    n, got = load(store, tokens)
    assert same_bytes(got, make_kv(tokens)[:, :, :n]), "wrong bytes served"
    return n


def remote_store(url: str, **extra):
    """A store of host memory (64 chunks) over the remote store at ``url``: round trips of
    at most 5 s (a loopback Redis on a machine busy with engine tests beside has missed
    1 s), a store found down tried again after 300 ms."""
    from kvtier import KVStore

    cfg = {"chunk_tokens": CHUNK, "host_capacity": 64 * CHUNK_BYTES, "remote_url": url,
           "remote_timeout": "5s", "remote_retry": "300ms", "io_threads": 2, **extra}
    return KVStore(SMALL, cfg, model="m")
