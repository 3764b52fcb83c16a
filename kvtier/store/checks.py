"""What a ``KVStore`` is given, checked before it takes anything: its layout, its model
name, and tiers that hold at least one chunk."""

from __future__ import annotations

from typing import Any

from kvtier.config.settings import KVTierConfig
from kvtier.errors import ConfigError, LayoutError
from kvtier.layout import KVLayout
from kvtier.tiers.base import TierName


def check_layout(layout: Any) -> None:
    if not isinstance(layout, KVLayout):
        raise LayoutError(f"kvtier KVStore: layout must be a KVLayout(num_layers, kv_heads, "
                          f"head_size, dtype), got {type(layout).__name__}")


def model_name(model: str | None, cfg: KVTierConfig) -> str:
    """``model``, else the ``model`` config key; ``ConfigError`` when neither names one."""
    name = model if model is not None else cfg.model
    if not name or not isinstance(name, str):
        raise ConfigError(
            "kvtier KVStore: no model name: pass KVStore(layout, config, model='org/name') or "
            "set the 'model' config key; it keeps apart the KV of models with the same layout"
        )
    return name


def check_tiers(cfg: KVTierConfig, tiers: set[TierName], chunk_tokens: int, slot_bytes: int) -> None:
    """``ConfigError`` when a capacity set holds no chunk, or nothing would hold one."""
    if cfg.gpu_capacity and TierName.GPU not in tiers:
        raise ConfigError(
            f"kvtier config: gpu_capacity={cfg.gpu_capacity} holds no chunk of "
            f"{slot_bytes} bytes ({chunk_tokens} tokens); raise gpu_capacity, "
            "lower chunk_tokens, or set it to 0 for no device pool")
    if TierName.HOST not in tiers and (cfg.disk_paths or not tiers):
        raise ConfigError(
            f"kvtier config: host_capacity={cfg.host_capacity} holds no chunk of "
            f"{slot_bytes} bytes ({chunk_tokens} tokens), and the disk tier and "
            "the store need at least one; raise host_capacity or lower chunk_tokens"
        )
