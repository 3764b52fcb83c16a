"""Which backend a ``remote_url`` names: ``redis://``, ``rediss://``,
``redis+cluster://``, ``rediss+cluster://`` (Valkey/Redis) and ``mooncake://`` (Mooncake
Store). Each backend's URL parser is imported only when used (``kvtier.remote.opening``
opens the backend)."""

from __future__ import annotations

from urllib.parse import urlsplit

from kvtier.config.redact import redacted

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
        from kvtier.config import redis_url
        return redis_url.check_url(url)
    from kvtier.config import mooncake_url
    return mooncake_url.check_url(url)
