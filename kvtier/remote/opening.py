"""Opening the remote tier a ``remote_url`` names. Backends are imported only when used, so
the core import stays light."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.config.remote_url import backend_of

if TYPE_CHECKING:
    from kvtier.config.settings import KVTierConfig
    from kvtier.keys import Namespace
    from kvtier.remote.base import RemoteTier


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
