"""Each I/O thread's own page-aligned buffers: slot headers, compressed payloads, decoded chunks."""

from __future__ import annotations

import threading

import numpy as np

from kvtier.io.buffers import AlignedBuffer


class ThreadScratch:
    """Buffers made once per thread, on first use: ``headers(count)`` for up to ``max_headers``
    headers of ``header_bytes``, ``payload()`` of ``stride`` bytes, ``raw()`` of ``raw_bytes``."""

    def __init__(self, max_headers: int, header_bytes: int, stride: int, raw_bytes: int) -> None:
        self.raw_bytes = raw_bytes
        self._sizes = {"header": max_headers * header_bytes, "payload": stride, "raw": raw_bytes}
        self._header_bytes = header_bytes
        self._local = threading.local()

    def _buffer(self, name: str) -> np.ndarray:
        buffer = getattr(self._local, name, None)
        if buffer is None:
            buffer = AlignedBuffer(self._sizes[name], pin=False)
            setattr(self._local, name, buffer)
        return buffer.array

    def headers(self, count: int) -> np.ndarray:
        return self._buffer("header")[: count * self._header_bytes]

    def payload(self) -> np.ndarray:
        return self._buffer("payload")

    def raw(self) -> np.ndarray:
        return self._buffer("raw")[: self.raw_bytes]
