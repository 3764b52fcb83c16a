"""kvtier's configuration: one typed, validated value, parsed once at the edge.

Sources, later ones winning key by key:

1. the defaults below;
2. the TOML, YAML or JSON file named by ``KVTIER_CONFIG``;
3. ``KVTIER_<KEY>`` environment variables (``KVTIER_HOST_CAPACITY=8GiB``);
4. the mapping given in code: vLLM's ``kv_connector_extra_config`` or ``KVStore(config=...)``.

An unknown key or a bad value raises :class:`~kvtier.errors.ConfigError` naming the key,
its source and the allowed values.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvtier.config import values
from kvtier.config.file import CONFIG_FILE_VAR, read_config_file
from kvtier.config.kinds import (
    Compression,
    DiskFloor,
    EvictionPolicyName,
    LoadPolicy,
    ODirect,
    WritePolicy,
    choice,
    disk_floor,
    o_direct,
    percent,
)
from kvtier.errors import ConfigError
from kvtier.logs import LOG_LEVEL_VAR, log_level
from kvtier.units import format_duration

__all__ = ["CONFIG_FILE_VAR", "Compression", "DiskFloor", "EvictionPolicyName", "KVTierConfig",
           "LoadPolicy", "ODirect", "WritePolicy", "load_config", "read_config_file"]

ENV_PREFIX = "KVTIER_"
FIVE_PERCENT = DiskFloor(fraction=0.05)  # disk_min_free's default
# variables that are not config keys: the config file, the log level (kvtier.logs) and
# the remote store's credentials (kvtier.config.redis_url), each read where it is used
_RESERVED_ENV = {CONFIG_FILE_VAR, LOG_LEVEL_VAR, "KVTIER_REMOTE_USERNAME",
                 "KVTIER_REMOTE_PASSWORD"}


@dataclass(frozen=True)
class KVTierConfig:
    """Every kvtier setting, validated. Build it with :func:`load_config`."""

    chunk_tokens: int = 256
    gpu_capacity: int = 0
    host_capacity: int = 4 * 1024**3
    disk_capacity: int = 64 * 1024**3
    disk_paths: tuple[str, ...] = ()
    disk_min_free: DiskFloor = FIVE_PERCENT
    disk_retry: float | None = 30.0  # seconds before a path out of service is tried again
    load_timeout: float | None = 10.0  # seconds a disk load may take before it is recomputed
    staging_wait: float | None = 0.25  # seconds a request may wait for host slots to stage in
    compression: Compression = Compression.NONE
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    load_policy: LoadPolicy = LoadPolicy.AUTO
    eviction_policy: EvictionPolicyName = EvictionPolicyName.LRU
    io_threads: int = 16
    o_direct: ODirect = ODirect.AUTO
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  # the address the metrics endpoints listen on
    model: str | None = None  # names the standalone KVStore's cache namespace; None: not set
    instance_id: str | None = None  # this writer's segment on a shared directory; None: derived
    share_refresh: float | None = 1.0  # seconds between looks at other writers' segments
    share_writers: int = 1  # writers that may hold a segment of one namespace's directory
    lease_timeout: float = 120.0  # seconds without a heartbeat before a writer counts as gone
    remote_url: str | None = None  # the remote tier's store (kvtier.remote); None: no remote tier
    remote_timeout: float = 1.0  # seconds one round trip to the remote store may take
    remote_retry: float = 10.0  # seconds a remote store that failed is left out of service
    remote_min_hits: int = 0  # loads a chunk earns before it is written to the remote store
    remote_prefix: str = "kvtier:"  # the remote store's keys start with it (ACLs, tenants)
    verify_sample: float = 0.001  # the share of hits (vLLM) checked against a recompute
    verify_tolerance: float | None = None  # relative; None: set by the KV cache's dtype
    verify_halt_after: int = 3  # mismatches after which hits stop until cleared; 0: never
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def check_block_tokens(self, block_tokens: int) -> None:
        """Raise ``ConfigError`` unless ``chunk_tokens`` is a multiple of the engine block."""
        if self.chunk_tokens % block_tokens:
            raise ConfigError(
                f"kvtier config: chunk_tokens={self.chunk_tokens} "
                f"({self.sources.get('chunk_tokens', 'default')}) must be a multiple of the "
                f"engine's block size {block_tokens}; use e.g. {block_tokens * 2}"
            )

    @property
    def segment_capacity(self) -> int:
        """The bytes one writer's segment may hold: ``disk_capacity`` is the bound of the
        namespace's directory as a whole, shared by at most ``share_writers`` writers."""
        return self.disk_capacity // self.share_writers

    def as_dict(self) -> dict[str, Any]:
        """Plain values (strings, ints, lists) keyed by config key, for printing or JSON.

        Given back as its key's value, each gives the same value (sizes as bytes, durations
        and percentages in exact digits), but for an unset ``model`` (""), which is refused."""
        out: dict[str, Any] = {}
        for name in KEYS:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
            if isinstance(value, StrEnum):
                out[name] = str(value)
            if isinstance(value, DiskFloor):
                out[name] = percent(value.fraction) if value.fraction else value.bytes
            if name in DURATION_KEYS:
                out[name] = "off" if value is None else format_duration(value)
            if name == "verify_tolerance":
                out[name] = "auto" if value is None else value
            if name in ("model", "instance_id", "remote_url"):
                out[name] = value or ""
        return out


DURATION_KEYS = ("disk_retry", "load_timeout", "staging_wait", "share_refresh", "lease_timeout",
                 "remote_timeout", "remote_retry")


# key -> (parser, allowed values as shown in errors)
_PARSERS: dict[str, tuple[Callable[[object], object], str]] = {
    "chunk_tokens": (values.int_in(1, 1 << 20), "a positive integer up to 1048576, a multiple of "
                     "the engine block size"),
    "gpu_capacity": (values.size, "a size such as 2GiB, or 0 for no device pool"),
    "host_capacity": (values.size, "a size such as 512MiB or 4GiB"),
    "disk_capacity": (values.size, "a size such as 100GiB"),
    "disk_paths": (values.paths, "a list of distinct directories, or one comma-separated string"),
    "disk_min_free": (disk_floor, "a percentage of each filesystem from 0% to below 100% such as 5% "
                      "or 0.5%, or a size such as 20GiB"),
    "disk_retry": (values.seconds_or_off(0.001), "a duration from 1ms to 1d such as 30s or 5m, "
                   "or off"),
    "load_timeout": (values.seconds_or_off(0.001), "a duration from 1ms to 1d such as 10s or 2m, "
                     "or off"),
    "staging_wait": (values.seconds_or_off(0.001), "a duration from 1ms to 1d such as 250ms or "
                     "1s, or off"),
    "compression": (choice(Compression), "none | zstd"),
    "write_policy": (choice(WritePolicy), "write_through | write_back"),
    "load_policy": (choice(LoadPolicy), "always | auto"),
    "eviction_policy": (choice(EvictionPolicyName), "lru | fifo"),
    "io_threads": (values.int_in(1, 256), "an integer from 1 to 256"),
    "o_direct": (o_direct, "auto | true | false"),
    "metrics_port": (values.optional_port, "a TCP port 1-65535, or 0, off or none for no metrics "
                     "endpoint"),
    "metrics_host": (values.listen_address, "an IP address to listen on: 127.0.0.1 (this machine "
                     "only), 0.0.0.0 (every interface) or one interface's address"),
    "model": (values.model, "a model name of 1 to 512 printable characters, e.g. Qwen/Qwen3-0.6B"),
    "instance_id": (values.instance_id, "1 to 64 letters, digits, '.', '_' or '-', starting with "
                    "a letter or digit, e.g. node3-engine0; empty: derived from the host name"),
    "share_refresh": (values.seconds_or_off(0.01), "a duration from 10ms to 1d such as 1s or "
                      "250ms, or off (a private cache: other writers' chunks are not looked for)"),
    "share_writers": (values.int_in(1, 4096), "an integer from 1 to 4096: the writers a shared "
                      "directory is sized for (each may fill disk_capacity / share_writers)"),
    "lease_timeout": (values.seconds_in(2.0, 86400.0), "a duration from 2s to 1d such as 2m"),
    "remote_url": (values.remote_url, "a store URL without credentials: redis://host:port/db, "
                   "rediss://host:port/db?ssl_ca_certs=FILE, redis+cluster://host:port, "
                   "mooncake://master-host:port; or empty, off or none"),
    "remote_timeout": (values.seconds_in(0.01, 60.0), "a duration from 10ms to 60s such as 1s"),
    "remote_retry": (values.seconds_in(0.1, 86400.0), "a duration from 100ms to 1d such as 10s"),
    "remote_min_hits": (values.int_in(0, 1 << 20), "an integer from 0 to 1048576: loads a chunk "
                        "earns before it is written to the remote store (0: every chunk stored)"),
    "remote_prefix": (values.key_prefix, "1 to 64 letters, digits, '.', '_', '-', ':' or '/'"),
    "verify_sample": (values.rate, "a share of hits from 0 to 1 such as 0.001, 0.1% or 1/1000; "
                      "0 or off for none"),
    "verify_tolerance": (values.tolerance, "auto (set by the KV cache's dtype), or a share of "
                         "a chunk's largest value from 0 (exact) to 1 such as 0.001"),
    "verify_halt_after": (values.int_in(0, 1 << 20), "an integer from 0 to 1048576: mismatches "
                          "after which hits stop until an operator clears them (0: never)"),
}
KEYS: tuple[str, ...] = tuple(_PARSERS)


def _parse_key(key: object, value: object, source: str) -> object:
    if not isinstance(key, str):
        raise ConfigError(
            f"kvtier config: key {values.shown(key)} ({source}) is not a string; "
            f"known keys: {', '.join(KEYS)}"
        )
    if key not in _PARSERS:
        close = difflib.get_close_matches(key, KEYS, n=1)
        hint = f"; did you mean '{close[0]}'? Known keys" if close else "; known keys"
        raise ConfigError(
            f"kvtier config: unknown key {values.shown(key)} ({source}){hint}: {', '.join(KEYS)}"
        )
    parse, allowed = _PARSERS[key]
    try:
        return parse(value)
    except (ValueError, TypeError, ArithmeticError, RecursionError) as exc:
        url = key == "remote_url"  # shown redacted, its reason whole (it says how to fix it)
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:500 if url else 200]
        shown = values.shown_url(value) if url else values.shown(value)
        raise ConfigError(
            f"kvtier config: bad value {shown} for '{key}' ({source})"
            f"{': ' + reason if reason else ''}; allowed: {allowed}"
        ) from exc


def load_config(
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> KVTierConfig:
    """Build the config from defaults, ``KVTIER_CONFIG``, ``KVTIER_<KEY>`` and ``overrides``."""
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError(
            f"kvtier config: bad given config {values.shown(overrides)}: a "
            f"{type(overrides).__name__}; allowed: a mapping of key to value, e.g. "
            "{'host_capacity': '8GiB'}"
        )
    environ = os.environ if environ is None else environ
    log_level(environ)  # a bad KVTIER_LOG_LEVEL stops start-up like a bad key
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if environ.get(CONFIG_FILE_VAR):
        file_path = environ[CONFIG_FILE_VAR]
        layers.append((f"file {file_path}", read_config_file(file_path)))
    env_values = {
        name[len(ENV_PREFIX):].lower(): value
        for name, value in environ.items()
        if name.startswith(ENV_PREFIX) and name not in _RESERVED_ENV
    }
    layers.append(("environment " + ENV_PREFIX + "{KEY}", env_values))
    layers.append(("given config", overrides or {}))

    parsed: dict[str, Any] = {}  # each value of its field's type, as its parser returns it
    sources: dict[str, str] = {}
    for label, mapping in layers:
        for key, raw in mapping.items():
            source = label.replace("{KEY}", key.upper()) if isinstance(key, str) else label
            parsed[key] = _parse_key(key, raw, source)
            sources[key] = source
    return dataclasses.replace(KVTierConfig(), **parsed, sources=sources)
