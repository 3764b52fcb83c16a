"""The remote tier: chunks in an existing distributed store, beyond one machine and one shared
directory. ``RemoteTier`` (base.py) is the contract, values.py the self-describing value
format, opening.py opens the backend a ``remote_url`` names (parsed in ``kvtier.config``:
remote_url.py, redis_url.py, mooncake_url.py, redact.py); the backends are redis_tier.py
(Valkey/Redis: ``redis://``, ``rediss://``, ``redis+cluster://``; the ``remote`` extra; its
client in redis_client.py, a cluster's round trip in redis_cluster.py) and mooncake_tier.py
(Mooncake Store: ``mooncake://``; the ``mooncake`` extra; its log of token records in
mooncake_log.py)."""
