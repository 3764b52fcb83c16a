"""The remote tier: chunks in an existing distributed store (Valkey/Redis), beyond one
machine and one shared directory. ``RemoteTier`` (base.py) is the contract, values.py the
self-describing value format, redis_tier.py the Valkey/Redis backend (``redis://``,
``rediss://``, ``redis+cluster://``; the ``remote`` extra installs its client)."""
