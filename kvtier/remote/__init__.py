"""The remote tier: chunks in an existing distributed store, beyond one machine and one shared
directory. ``RemoteTier`` (base.py) is the contract, values.py the self-describing value
format, urls.py what a ``remote_url`` names, redact.py a URL as logs and errors show it; the
backends are redis_tier.py (Valkey/Redis: ``redis://``, ``rediss://``, ``redis+cluster://``;
the ``remote`` extra; its URL in redis_url.py, its client in redis_client.py, a cluster's
round trip in redis_cluster.py) and mooncake_tier.py (Mooncake Store: ``mooncake://``; the
``mooncake`` extra)."""
