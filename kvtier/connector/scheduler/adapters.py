"""What a LoRA adapter's files hold, in the keys of the chunks computed with it.

vLLM keys an adapter's blocks by the adapter's name and path only: enough inside one process,
whose adapters do not change under it, but chunks outlive the process (disk, a shared
directory, a remote store). An adapter whose files were replaced under the same path (a new
version rolled out), or that another engine of the fleet holds in another version at that
path, would load KV the other adapter computed. So each adapter a request names is read
(``weights_digest`` of its weight files, and its ``adapter_config.json``) and that digest goes
into its chunks' keys. An adapter that is not a local directory (a hub name) is named by name
and path, as vLLM names it.

The files are read off the scheduler's step, on threads of their own (``RequestKeys`` keeps
each request's digest once known, and waits a little for it). The last ``KEPT`` adapters'
digests are kept; one used again after that is read again. An adapter replaced under its
path while the engine runs is told apart only once it is read again (vLLM may load the new
files when its adapter cache dropped the old ones): roll adapters out under new paths.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections import OrderedDict
from typing import Any

from kvtier.connector.common.model_settings import config_bytes
from kvtier.connector.common.weights_digest import weights_digest
from kvtier.io.guarded import start_thread

CONFIG_FILE = "adapter_config.json"
KEPT = 4096  # adapters whose digest is kept (least recently used dropped past it)
READERS = 2  # threads reading adapters' files (daemons: a hung mount holds no exit)
_READING = b""  # a read under way (no digest is empty)


class AdapterDigests:
    """Contract: ``of(request)`` never blocks: b"" for a request without an adapter, the
    digest of its adapter's files once read (the same bytes for the same files in every
    engine, other bytes for other files), None until then (the read is started). ``settle``
    waits up to ``timeout`` for the reads started; ``close()`` stops reading."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._kept: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._todo: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        self._readers: list[threading.Thread] = []

    def of(self, request: Any) -> bytes | None:
        lora = getattr(request, "lora_request", None)
        if not lora:
            return b""
        name_path = (str(getattr(lora, "lora_name", "")), str(getattr(lora, "lora_path", "")))
        with self._lock:
            digest = self._kept.get(name_path)
            if digest is None:
                self._start(name_path)
                return None
            self._kept.move_to_end(name_path)
            if not digest:  # being read: by a reader, once one could start
                self._add_reader()
            return digest or None

    def _start(self, name_path: tuple[str, str]) -> None:
        self._kept[name_path] = _READING
        while len(self._kept) > KEPT:
            oldest = next((k for k, v in self._kept.items() if v != _READING), None)
            if oldest is None:
                break
            del self._kept[oldest]
        self._add_reader()
        self._todo.put(name_path)

    def _add_reader(self) -> None:
        """One reader more, up to ``READERS`` (one refused now: tried again at the next ask)."""
        if len(self._readers) < READERS:
            reader = threading.Thread(target=self._read, name="kvtier-adapters", daemon=True)
            if start_thread(reader):
                self._readers.append(reader)

    def _read(self) -> None:
        while (name_path := self._todo.get()) is not None:
            try:
                digest = adapter_digest(name_path[1])
            except Exception:  # never shared: another engine cannot name these chunks
                digest = b"lora:unread:" + os.urandom(16)
            with self._lock:
                if self._kept.get(name_path) == _READING:
                    self._kept[name_path] = digest
                self._lock.notify_all()

    def settle(self, timeout: float) -> None:
        with self._lock:
            self._lock.wait_for(lambda: _READING not in self._kept.values(), timeout)

    def close(self) -> None:
        for _ in self._readers:
            self._todo.put(None)


def adapter_digest(path: str) -> bytes:
    """A digest of the adapter directory ``path``'s weights and config; a fixed marker for
    one that is not a local directory (its name and path already key it)."""
    path = os.path.expanduser(path)  # as vLLM finds it
    if not os.path.isdir(path):
        return b"lora:not-local"
    config = config_bytes(path, CONFIG_FILE) or b""
    text = f"{weights_digest(path)}|".encode() + hashlib.blake2b(config, digest_size=8).digest()
    return b"lora:" + hashlib.blake2b(text, digest_size=16).digest()
