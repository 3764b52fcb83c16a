"""Reading the config file named by ``KVTIER_CONFIG``: a regular file of at most 1 MiB of
UTF-8 text (never a FIFO or a device, which could block), parsed as TOML, YAML or JSON."""

from __future__ import annotations

import json
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

CONFIG_FILE_VAR = "KVTIER_CONFIG"
MAX_CONFIG_FILE_BYTES = 1 << 20


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the mapping in a .toml, .yaml/.yml or .json config file.

    The file must be a regular file of at most 1 MiB of UTF-8 text holding a table of keys
    (at the top level or under ``kvtier``); anything else raises ``ConfigError``.
    """
    path = Path(path)
    if path.suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ConfigError(
            f"kvtier config: {path} has suffix '{path.suffix}'; use .toml, .yaml, .yml or .json"
        )
    text = _read_text(path)
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except RecursionError as exc:
        raise ConfigError(f"kvtier config: cannot parse {path}: nested too deeply") from exc
    except Exception as exc:  # each parser has its own error type; all mean "bad file"
        raise ConfigError(f"kvtier config: cannot parse {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"kvtier config: {path} must hold a table of keys, not {type(data).__name__}")
    return data.get("kvtier", data) if isinstance(data.get("kvtier"), dict) else data


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
