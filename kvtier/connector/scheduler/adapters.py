"""What a LoRA adapter's files hold, in the keys of the chunks computed with it.

vLLM keys an adapter's blocks by the adapter's name and path only: enough inside one process,
whose adapters do not change under it, but chunks outlive the process (disk, a shared
directory, a remote store). An adapter whose files were replaced under the same path (a new
version rolled out), or that another engine of the fleet holds in another version at that
path, would load KV the other adapter computed. So each adapter a request names is read once
per engine (``weights_digest`` of its weight files, and its ``adapter_config.json``) and that
digest goes into its chunks' keys. An adapter that is not a local directory (a hub name) is
named by name and path, as vLLM names it.

The files are read off the scheduler's step, on a thread of their own: until an adapter's
digest is known its requests neither load nor store chunks (they compute, as without
kvtier); their chunks are offered for store at a later step, once it is. An adapter replaced
under its path while the engine runs is not read again (vLLM may load the new files when its
adapter cache dropped the old ones): roll adapters out under new paths, or restart.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from kvtier.connector.common.weights_digest import weights_digest

CONFIG_FILE, CONFIG_BYTES = "adapter_config.json", 4 * 1024 * 1024
KEPT = 4096  # adapters an engine keys its chunks by; requests of any more skip kvtier
READERS = 2  # threads reading adapters' files


class AdapterDigests:
    """Contract: ``of(request)`` never blocks: b"" for a request without an adapter, the
    digest of its adapter's files once read (the same bytes for the same files in every
    engine, other bytes for other files), None until then (the read is started) or for an
    adapter past the first ``KEPT``. A digest once known stays for the engine's life.
    ``settle(timeout)`` waits for the reads started; ``close()`` stops reading."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reads: dict[tuple[str, str], Future[bytes]] = {}
        self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="kvtier-adapters")

    def of(self, request: Any) -> bytes | None:
        lora = getattr(request, "lora_request", None)
        if not lora:
            return b""
        name_path = (str(getattr(lora, "lora_name", "")), str(getattr(lora, "lora_path", "")))
        with self._lock:
            read = self._reads.get(name_path)
            if read is None:
                if len(self._reads) >= KEPT:
                    return None
                read = self._reads[name_path] = self._pool.submit(adapter_digest, name_path[1])
        if not read.done() or read.exception() is not None:
            return None
        return read.result()

    def settle(self, timeout: float) -> None:
        with self._lock:
            reads = list(self._reads.values())
        wait(reads, timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def adapter_digest(path: str) -> bytes:
    """A digest of the adapter directory ``path``'s weights and config; a fixed marker for
    one that is not a local directory (its name and path already key it)."""
    path = os.path.expanduser(path)  # as vLLM finds it
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
