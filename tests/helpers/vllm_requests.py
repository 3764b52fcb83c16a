"""Requests as vLLM's scheduler sees them, their block hashes made by vLLM itself (sha256,
its default), and vLLM's chain of hashes over a list of tokens; for the KV event tests.
Import only where vLLM is installed."""

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, hash_block_tokens, init_none_hash
from vllm.v1.request import Request


def vllm_request(name: str, tokens: list[int], block: int, hash_block: int | None = None,
                 salt: str | None = None) -> Request:
    """A request of ``tokens``, hashed every ``hash_block`` tokens (``block`` by default)."""
    init_none_hash(sha256)
    return Request(name, tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(hash_block or block, sha256))


def vllm_chain(tokens: list[int], block: int) -> list[bytes]:
    """vLLM's hash of each full block of ``block`` tokens, chained by parent hash."""
    init_none_hash(sha256)
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block + 1, block):
        hashes.append(hash_block_tokens(sha256, hashes[-1] if hashes else None,
                                        tokens[start:start + block]))
    return hashes
