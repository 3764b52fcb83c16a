"""The remote tier: chunks in an existing distributed store, beyond one machine and one shared
directory. ``RemoteTier`` (base.py) is the contract, values.py the self-describing value
format, urls.py what a ``remote_url`` names; the backends are redis_tier.py (Valkey/Redis:
``redis://``, ``rediss://``, ``redis+cluster://``; the ``remote`` extra) and mooncake_tier.py
(Mooncake Store: ``mooncake://``; the ``mooncake`` extra)."""
