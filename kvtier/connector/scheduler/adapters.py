"""What a LoRA adapter's files hold, in the keys of the chunks computed with it.

vLLM keys an adapter's blocks by the adapter's name and path only: enough inside one process,
whose adapters do not change under it, but chunks outlive the process (disk, a shared
directory, a remote store). An adapter whose files were replaced under the same path (a new
version rolled out), or that another engine of the fleet holds in another version at that
path, would load KV the other adapter computed. So each adapter a request names is read once
per engine (``weights_digest`` of its weight files, and its ``adapter_config.json``) and that
digest goes into its chunks' keys. An adapter that is not a local directory (a hub name) is
named by name and path, as vLLM names it.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import Any

from kvtier.connector.common.weights_digest import weights_digest

CONFIG_FILE, CONFIG_BYTES = "adapter_config.json", 4 * 1024 * 1024
KEPT = 4096  # adapters whose digest is kept, the least recently used dropped past it


class AdapterDigests:
    """Contract: ``of(request)`` is b"" for a request without an adapter, else a digest of
    its adapter's files (read at the first request naming that name and path, then kept):
    the same bytes for the same files in every engine, another for other files."""

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[str, str], bytes] = OrderedDict()

    def of(self, request: Any) -> bytes:
        lora = getattr(request, "lora_request", None)
        if not lora:
            return b""
        name_path = (str(getattr(lora, "lora_name", "")), str(getattr(lora, "lora_path", "")))
        digest = self._kept.get(name_path)
        if digest is None:
            digest = adapter_digest(name_path[1])
            self._kept[name_path] = digest
            if len(self._kept) > KEPT:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(name_path)
        return digest


def adapter_digest(path: str) -> bytes:
    """A digest of the adapter directory ``path``'s weights and config; a fixed marker for
    one that is not a local directory (its name and path already key it)."""
    if not os.path.isdir(path):
        return b"lora:not-local"
    config = b""
    try:  # the engine's own adapter directory (vLLM reads it), not a cache root
        with open(os.path.join(path, CONFIG_FILE), "rb") as file:
            config = file.read(CONFIG_BYTES)
    except OSError:
        pass
    text = f"{weights_digest(path)}|".encode() + hashlib.blake2b(config, digest_size=8).digest()
    return b"lora:" + hashlib.blake2b(text, digest_size=16).digest()
