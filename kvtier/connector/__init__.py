"""The vLLM adapter (``kv_connector_module_path = "kvtier.connector"``).

The only part of kvtier that imports vLLM, and only when ``KVTierConnector`` is asked for:
geometry and page copies import without it.
"""

__all__ = ["KVTierConnector"]


def __getattr__(name: str):
    if name == "KVTierConnector":
        from kvtier.connector.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module 'kvtier.connector' has no attribute {name!r}")
