import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from kvtier.keys import KEY_BYTES, Namespace, block_hash_chunk_key, token_chunk_keys

NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=32)

# The digest of NS: fixed forever for its format version. A change
# here means every cache on disk becomes unreadable: bump FORMAT_VERSION instead.
NS_DIGEST = "a3e39612a260f2923645bd39e9ee96a0"  # format version 3


def test_namespace_digest_is_fixed():
    assert len(NS.digest()) == KEY_BYTES
    assert NS.id == NS_DIGEST


@pytest.mark.parametrize(("field", "value"), [
    ("model", "other"), ("kv_dtype", "float16"), ("layout", "l2"), ("layout_version", 2),
    ("block_tokens", 32), ("chunk_tokens", 64), ("model_revision", "abc"), ("tp_size", 2),
    ("pp_size", 2), ("format_version", 4), ("model_settings", "0123abcd"),
])
def test_every_field_changes_the_digest(field, value):
    assert dataclasses.replace(NS, **{field: value}).digest() != NS.digest()


def test_rank_changes_the_digest():
    a = dataclasses.replace(NS, tp_size=2, tp_rank=0)
    assert a.digest() != dataclasses.replace(a, tp_rank=1).digest()


@pytest.mark.parametrize("kwargs", [
    {"chunk_tokens": 24}, {"chunk_tokens": 0}, {"tp_rank": 1}, {"pp_rank": -1},
])
def test_bad_namespaces_are_refused(kwargs):
    with pytest.raises(ValueError):
        dataclasses.replace(NS, **kwargs)


def test_only_full_chunks_have_keys():
    assert token_chunk_keys(NS, []) == []
    assert token_chunk_keys(NS, range(31)) == []
    assert len(token_chunk_keys(NS, range(32))) == 1
    assert len(token_chunk_keys(NS, range(95))) == 2


def test_keys_are_chained_over_the_whole_prefix():
    a = token_chunk_keys(NS, list(range(96)))
    b = token_chunk_keys(NS, [999, *list(range(1, 96))])  # first token differs
    assert len(set(a)) == 3
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert token_chunk_keys(NS, list(range(64))) == a[:2]


def test_token_types_do_not_change_keys():
    tokens = list(range(64))
    expected = token_chunk_keys(NS, tokens)
    assert token_chunk_keys(NS, np.array(tokens, dtype=np.int32)) == expected
    assert token_chunk_keys(NS, np.array(tokens, dtype=np.uint64)) == expected


def test_non_integer_tokens_are_refused():
    with pytest.raises(ValueError, match="1-D sequence of integers"):
        token_chunk_keys(NS, [0.5] * 32)


def test_namespaces_never_share_keys():
    other = dataclasses.replace(NS, kv_dtype="float16")
    assert not set(token_chunk_keys(NS, range(64))) & set(token_chunk_keys(other, range(64)))
    assert block_hash_chunk_key(NS, b"h") != block_hash_chunk_key(other, b"h")


def test_keys_are_stable_across_processes_and_hash_seeds():
    script = (
        "from kvtier.keys import Namespace, token_chunk_keys, block_hash_chunk_key;"
        "ns = Namespace(model='m', kv_dtype='bfloat16', layout='l', block_tokens=16, chunk_tokens=32);"
        "print(ns.id, token_chunk_keys(ns, range(64))[-1].hex(), block_hash_chunk_key(ns, b'x').hex())"
    )
    outputs = set()
    for seed in ("1", "2", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outputs.add(subprocess.check_output([sys.executable, "-c", script], env=env, text=True))
    assert len(outputs) == 1
    here = f"{NS.id} {token_chunk_keys(NS, range(64))[-1].hex()} {block_hash_chunk_key(NS, b'x').hex()}"
    assert outputs.pop().strip() == here


def test_a_namespace_digest_is_computed_once(monkeypatch):
    from kvtier import keys

    ns = keys.Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=32)
    first = ns.digest()
    monkeypatch.setattr(keys.hashlib, "blake2b", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("digest computed again")))
    assert ns.digest() == first and ns.id == first.hex()
