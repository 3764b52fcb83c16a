"""Namespaces and chunk keys.

A :class:`Namespace` names everything that makes two caches' KV bytes incompatible. Its
digest seeds every chunk key, so chunks of different namespaces never share a key, and it is
written into every on-disk slot so a reader can check where bytes came from.

A chunk key names one chunk of ``chunk_tokens`` tokens *and everything before it*: keys are
chained, so equal keys mean equal prefixes. Hashes are BLAKE2b (stable across processes,
machines and restarts; never Python's salted ``hash()``) and collision-resistant, so one
tenant cannot craft a prompt whose key collides with another's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import NewType

import numpy as np

from kvtier.errors import TokenError

FORMAT_VERSION = 3  # 3: payloads in parts (a part table in the header)
KEY_BYTES = 16

ChunkKey = NewType("ChunkKey", bytes)
"""16 bytes naming a chunk and its whole prefix within one namespace."""


@dataclass(frozen=True)
class Namespace:
    """Everything that makes KV bytes incompatible between two caches.

    ``layout`` names the order of a chunk's dimensions and ``layout_version`` its revision;
    ``block_tokens`` is the engine's page size and ``chunk_tokens`` kvtier's unit of storage;
    ``model_settings`` a digest of what else changes the bytes for the same tokens (an
    engine's rope scaling, quantization, model length: ``connector.common.model_settings``;
    left out of the digest when empty, as for the standalone store).
    """

    model: str
    kv_dtype: str
    layout: str
    block_tokens: int
    chunk_tokens: int
    layout_version: int = 1
    model_revision: str = ""
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    format_version: int = FORMAT_VERSION
    model_settings: str = ""

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0 or self.block_tokens <= 0:
            raise ValueError(f"{self}: block_tokens and chunk_tokens must be positive")
        if self.chunk_tokens % self.block_tokens:
            raise ValueError(
                f"chunk_tokens={self.chunk_tokens} must be a multiple of "
                f"block_tokens={self.block_tokens}"
            )
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"rank out of range: tp {self.tp_rank}/{self.tp_size}, "
                             f"pp {self.pp_rank}/{self.pp_size}")

    def canonical_json(self) -> str:
        """The fields as sorted JSON: the exact bytes the digest covers."""
        fields = asdict(self)
        if not self.model_settings:  # namespaces made before it existed keep their digest
            del fields["model_settings"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    def digest(self) -> bytes:
        """16-byte stable digest of every field (computed once: keys of every chunk use it)."""
        return self._digest

    @cached_property
    def _digest(self) -> bytes:
        return _namespace_digest(self.canonical_json())

    @property
    def id(self) -> str:
        """The digest in hex: the namespace's name in file names, logs and the CLI."""
        return self.digest().hex()


def _namespace_digest(canonical_json: str) -> bytes:
    return hashlib.blake2b(canonical_json.encode(), digest_size=KEY_BYTES,
                           person=b"kvtier-ns").digest()


def namespace_id_of(canonical_json: str) -> str:
    """The id of the namespace whose canonical JSON is given (what a namespace directory is
    named after, so its description can be checked against its name)."""
    return _namespace_digest(canonical_json).hex()


_INT64 = np.iinfo(np.int64)


def _as_int64(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as little-endian int64; ``TokenError`` for anything else (ids outside int64
    would wrap, and two different prompts would share keys)."""
    try:
        array = np.asarray(tokens)
    except (OverflowError, ValueError, TypeError) as exc:
        raise TokenError(f"tokens must be a 1-D sequence of integers: {exc}") from None
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TokenError(f"tokens must be a 1-D sequence of integers in int64's range, got "
                         f"{array.dtype} {array.shape}")
    if array.size and array.dtype.kind == "u" and array.max() > _INT64.max:
        raise TokenError(f"token id {int(array.max())} is outside int64's range; token ids "
                         "must be integers from -2**63 to 2**63-1")
    return array.astype("<i8", copy=False)


def token_chunk_keys(
    namespace: Namespace, tokens: Sequence[int] | np.ndarray
) -> list[ChunkKey]:
    """Keys of every *full* chunk of ``tokens``; a trailing partial chunk has no key.

    ``key[i] = BLAKE2b(key[i-1] || tokens of chunk i as little-endian int64)``, with
    ``key[-1]`` the namespace digest.
    """
    array = _as_int64(tokens)
    size = namespace.chunk_tokens
    parent = namespace.digest()
    keys: list[ChunkKey] = []
    for start in range(0, len(array) - size + 1, size):
        parent = hashlib.blake2b(
            parent + array[start:start + size].tobytes(), digest_size=KEY_BYTES
        ).digest()
        keys.append(ChunkKey(parent))
    return keys


def block_hash_chunk_key(namespace: Namespace, last_block_hash: bytes, extra: bytes = b"") -> ChunkKey:
    """Key of a chunk from the engine's hash of the chunk's last block, and ``extra``: what
    else computed it that the hash does not cover (a LoRA adapter's files).

    vLLM's block hashes are already chained over the whole prefix (and the request's cache
    salt), so the last block's hash names the chunk and everything before it.
    """
    return ChunkKey(hashlib.blake2b(namespace.digest() + bytes(last_block_hash) + extra,
                                    digest_size=KEY_BYTES).digest())


def tail_chunk_key(namespace: Namespace, parent: bytes, tokens: Sequence[int] | np.ndarray,
                   extra: bytes = b"") -> ChunkKey:
    """Key of a prompt's partial last chunk: ``parent`` (the engine's hash of the prompt's
    last full block, chained over everything before it; empty when there is none), the
    tokens after that block and ``extra`` (what else the engine keys a block on: cache salt,
    adapter), so that it matches only a prompt identical up to its last token. Never equal
    to a full chunk's key (a different domain)."""
    array = _as_int64(tokens)
    return ChunkKey(hashlib.blake2b(
        b"kvtier-tail" + namespace.digest() + len(parent).to_bytes(2, "little") + bytes(parent)
        + len(extra).to_bytes(4, "little") + extra + array.tobytes(), digest_size=KEY_BYTES,
    ).digest())
