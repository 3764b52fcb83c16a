"""Typed exceptions raised at kvtier's public edge.

Inside kvtier, "no room" is ``None`` and an I/O outcome is a result value; exceptions are
for the caller: a bad configuration, a request that does not fit the store's layout.
"""


class KVTierError(Exception):
    """Base class of every exception kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration key is unknown or its value is not allowed.

    The message names the key, where it came from, and the allowed values.
    """


class LayoutError(KVTierError, ValueError):
    """A tensor handed to the store does not match the store's KV layout."""


class TokenError(KVTierError, ValueError):
    """Token ids that are not a 1-D sequence of integers in int64's range."""


class StoreClosedError(KVTierError, RuntimeError):
    """The store was used after ``close()``."""
