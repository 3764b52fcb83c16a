"""The memory a Mooncake Store client moves chunks from and into: buffers registered with
its transfer engine (the host tier's: chunks in them move with no copy), and each thread's
registered scratch (value headers, and chunks outside registered memory, copied through)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.remote.mooncake_client import code_name

log = logging.getLogger("kvtier")


class RegisteredMemory:
    """Memory given to ``add`` (registered with each client as it is set up) and the
    scratch areas of the threads; thread-safe. ``staged`` counts the chunks copied through
    a scratch."""

    def __init__(self, url: str, header_bytes: int, raw_bytes: int) -> None:
        self._url, self._hb, self._raw_bytes = url, header_bytes, raw_bytes
        self._lock = threading.Lock()
        self._memory: list[np.ndarray] = []  # given to add()
        self._registered: list[tuple[int, int]] = []  # (start, end) the client knows
        self._scratch: list[np.ndarray] = []  # every thread's, alive while the client is
        self._local = threading.local()
        self.staged = 0

    def add(self, flat: np.ndarray, client: Any) -> None:
        """Keep ``flat`` (contiguous ``uint8``) and register it with ``client`` if set up."""
        with self._lock:
            self._memory.append(flat)
        if client is not None:
            self.register(client, flat)

    def register_all(self, client: Any) -> None:
        """Register all memory added with ``client``, just set up."""
        with self._lock:
            memory = list(self._memory)
        for flat in memory:
            self.register(client, flat)

    def register(self, client: Any, flat: np.ndarray) -> None:
        start = flat.ctypes.data
        code = client.register_buffer(start, flat.nbytes)
        if code != 0:
            log.warning("kvtier: remote tier %s: registering %d bytes failed (%s); chunks in them "
                        "are copied", self._url, flat.nbytes, code_name(code))
            return
        with self._lock:
            self._registered.append((start, start + flat.nbytes))

    def direct(self, flat: np.ndarray) -> bool:
        """Whether a chunk at ``flat`` lies in registered memory (moves with no copy)."""
        start = flat.ctypes.data
        with self._lock:
            return any(low <= start and start + self._raw_bytes <= high
                       for low, high in self._registered)

    def area(self, client: Any, nbytes: int) -> np.ndarray:
        """This thread's registered scratch, of ``nbytes`` at least (``OSError`` if refused).
        One it outgrew is unregistered and let go: only this thread's calls use it, and the
        one before this has returned."""
        old: np.ndarray | None = getattr(self._local, "area", None)
        same = getattr(self._local, "client", None) is client
        if old is not None and same and old.nbytes >= nbytes:
            return old
        grown = 0 if old is None else 2 * old.nbytes  # doubling: rarely registered again
        area = np.zeros(max(nbytes, grown, 64 * self._hb), np.uint8)
        code = client.register_buffer(area.ctypes.data, area.nbytes)
        if code != 0:
            raise OSError(f"registering {area.nbytes} bytes of scratch failed ({code_name(code)})")
        with self._lock:
            self._scratch.append(area)
            if old is not None:  # (another client's went with it)
                self._scratch = [kept for kept in self._scratch if kept is not old]
        if old is not None and same:
            code = client.unregister_buffer(old.ctypes.data)
            if code != 0:
                log.debug("kvtier: remote tier %s: unregistering %d bytes of scratch failed (%s)",
                          self._url, old.nbytes, code_name(code))
        self._local.area, self._local.client = area, client
        return area

    def pieces(self, client: Any, bufs: Sequence[np.ndarray]
               ) -> tuple[list[np.ndarray], list[np.ndarray], list[bool]]:
        """Header slot, payload memory and whether it is staged, for each chunk of a call
        (``bufs``: the chunks' own bytes, contiguous ``uint8``)."""
        staged = [not self.direct(b) for b in bufs]
        raw = self._raw_bytes
        area = self.area(client, len(bufs) * self._hb + sum(staged) * raw)
        headers = [area[i * self._hb:(i + 1) * self._hb] for i in range(len(bufs))]
        payloads: list[np.ndarray] = []
        at = len(bufs) * self._hb
        for buf, copy in zip(bufs, staged, strict=True):
            payloads.append(area[at:at + raw] if copy else buf[:raw])
            at += raw if copy else 0
        if any(staged):
            with self._lock:
                self.staged += sum(staged)
        return headers, payloads, staged
