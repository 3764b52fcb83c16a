"""Which backend a ``remote_url`` names, and opening it: ``redis://``, ``rediss://``,
``redis+cluster://``, ``rediss+cluster://`` (Valkey/Redis) and ``mooncake://`` (Mooncake
Store). Backends are imported only when used, so the core import stays light."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvtier.remote.redact import redacted

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig
    from kvtier.keys import Namespace
    from kvtier.remote.base import RemoteTier

REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
MOONCAKE_SCHEMES = ("mooncake",)


def backend_of(url: str) -> str:
    """``redis`` or ``mooncake``: the backend ``url`` names (as metrics label it)."""
    scheme = urlsplit(url).scheme.lower()
    if scheme in REDIS_SCHEMES:
        return "redis"
    if scheme in MOONCAKE_SCHEMES:
        return "mooncake"
    raise ValueError(f"remote_url {redacted(url)!r}: the scheme must be one of "
                     f"{', '.join(REDIS_SCHEMES + MOONCAKE_SCHEMES)}")


def check_url(url: str) -> str:
    """``url`` when a backend can use it; ``ValueError`` saying what is wrong."""
    if backend_of(url) == "redis":
        from kvtier.remote import redis_url

        return redis_url.check_url(url)
    from kvtier.remote import mooncake_url

    return mooncake_url.check_url(url)


def open_remote(config: KVTierConfig, namespace: Namespace, raw_bytes: int,
                parts: Sequence[int] = ()) -> RemoteTier | None:
    """The remote tier ``config.remote_url`` names for chunks of ``raw_bytes`` of
    ``namespace`` (in ``parts`` of those bytes each, for a hybrid model), or None without
    one. Connecting is lazy: a store down now is a tier out
    of service later, never a failed start."""
    url = config.remote_url
    if url is None:
        return None
    timeout, retry, prefix = config.remote_timeout, config.remote_retry, config.remote_prefix
    if backend_of(url) == "redis":
        from kvtier.remote.redis_tier import RedisTier

        return RedisTier(url, namespace, raw_bytes, timeout_s=timeout, retry_s=retry, prefix=prefix,
                         parts=parts)
    from kvtier.remote.mooncake_tier import MooncakeTier

    return MooncakeTier(url, namespace, raw_bytes, timeout_s=timeout, retry_s=retry, prefix=prefix,
                        parts=parts)
