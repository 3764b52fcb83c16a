"""Reading the config file named by ``KVTIER_CONFIG``: a regular file of at most 1 MiB of
UTF-8 text (never a FIFO or a device, which could block), parsed as TOML, YAML or JSON."""

from __future__ import annotations

import json
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from kvtier.config.values import shown
from kvtier.errors import ConfigError

CONFIG_FILE_VAR = "KVTIER_CONFIG"
MAX_CONFIG_FILE_BYTES = 1 << 20


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the mapping in a .toml, .yaml/.yml or .json config file.

    The file must be a regular file of at most 1 MiB of UTF-8 text holding a table of keys
    (at the top level, or all of them under ``kvtier``), each key once; anything else
    raises ``ConfigError``.
    """
    path = Path(path)
    if path.suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ConfigError(
            f"kvtier config: {path} has suffix '{path.suffix}'; use .toml, .yaml, .yml or .json"
        )
    text = _read_text(path)
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)  # refuses a key given twice itself
        elif path.suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_keys)
        else:
            data = _load_yaml(text) or {}
    except RecursionError as exc:
        raise ConfigError(f"kvtier config: cannot parse {path}: nested too deeply") from exc
    except _KeyTwice as exc:
        raise ConfigError(f"kvtier config: {path} gives key {shown(exc.key)} twice; give each "
                          "key once") from exc
    except Exception as exc:  # each parser has its own error type; all mean "bad file"
        raise ConfigError(f"kvtier config: cannot parse {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"kvtier config: {path} must hold a table of keys, not {type(data).__name__}")
    if not isinstance(data.get("kvtier"), dict):
        return data
    outside = [shown(key) for key in data if key != "kvtier"]
    if outside:
        raise ConfigError(f"kvtier config: {path} has a kvtier table and keys outside it "
                          f"({', '.join(outside[:10])}{', ...' if len(outside) > 10 else ''}); "
                          "put every key in the kvtier table, or every key at the top level")
    return data["kvtier"]


class _KeyTwice(ValueError):
    def __init__(self, key: object) -> None:
        super().__init__(f"key {shown(key)} given twice")
        self.key = key


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A JSON object as a dict; ``_KeyTwice`` for a key it gives twice."""
    table: dict[Any, Any] = {}
    for key, value in pairs:
        if key in table:
            raise _KeyTwice(key)
        table[key] = value
    return table


def _load_yaml(text: str) -> Any:
    """``yaml.safe_load``, but ``_KeyTwice`` for a mapping that gives a key twice."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    key = self.construct_object(key_node)
                    if key in seen:
                        raise _KeyTwice(key)
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader: builds no objects


def _read_text(path: Path) -> str:
    """The UTF-8 text of the regular file at ``path``; never blocks on a FIFO or a device."""
    where = f"{CONFIG_FILE_VAR} file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"kvtier config: cannot read {where}: {exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"kvtier config: {where} is not a regular file")
        chunks, size = [], 0
        while size <= MAX_CONFIG_FILE_BYTES and (chunk := os.read(fd, 1 << 16)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(f"kvtier config: cannot read {where}: {exc}") from exc
    finally:
        os.close(fd)
    if size > MAX_CONFIG_FILE_BYTES:
        raise ConfigError(f"kvtier config: {where} is larger than 1 MiB; is it the right file?")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"kvtier config: {where} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from exc
