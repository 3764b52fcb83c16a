"""kvtier: tiered KV-cache offload for LLM serving (GPU, pinned host memory, NVMe).

``import kvtier`` is light: torch and the store load on first use of ``kvtier.KVStore``.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["ChunkKey", "KVLayout", "KVStore", "KVTierConfig", "Namespace", "PrefixHit",
           "load_config"]

_LAZY = {
    "KVStore": "kvtier.store.kvstore",
    "PrefixHit": "kvtier.store.kvstore",
    "KVLayout": "kvtier.layout",
    "KVTierConfig": "kvtier.config.settings",
    "load_config": "kvtier.config.settings",
    "Namespace": "kvtier.keys",
    "ChunkKey": "kvtier.keys",
}

if TYPE_CHECKING:
    from kvtier.config.settings import KVTierConfig, load_config
    from kvtier.keys import ChunkKey, Namespace
    from kvtier.layout import KVLayout
    from kvtier.store.kvstore import KVStore, PrefixHit


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
