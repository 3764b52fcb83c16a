"""Payload codecs: byte-plane shuffle then zstd for 16-bit KV.

Shuffling puts the high bytes of every bf16/fp16 element together, where zstd finds more to
compress (measured on normally distributed bf16 values at level 1: 1.46x smaller; about
0.25 GB/s to compress and 2.7 GB/s to decompress on one core here). It pays only where the
disk link is slower than the codec, so it is off by default.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from kvtier.io.format import Codec

LEVEL = 1
_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "c"):
        _local.c = zstandard.ZstdCompressor(level=LEVEL)
        _local.d = zstandard.ZstdDecompressor()
    return _local.c


def _decompressor() -> zstandard.ZstdDecompressor:
    _compressor()
    return _local.d


def _shuffle(raw: np.ndarray) -> np.ndarray:
    """Low bytes of every 16-bit element, then high bytes."""
    words = raw.view(np.uint16)
    planes = np.empty((2, words.size), dtype=np.uint8)
    np.copyto(planes[0], words, casting="unsafe")
    np.copyto(planes[1], words >> 8, casting="unsafe")
    return planes


def _unshuffle(planes: np.ndarray, out: np.ndarray) -> None:
    low, high = planes.reshape(2, -1)
    words = out.view(np.uint16)
    np.left_shift(high, 8, out=words, dtype=np.uint16)
    np.bitwise_or(words, low, out=words)


def encode(raw: np.ndarray, element_bytes: int) -> tuple[Codec, bytes] | None:
    """Compress ``raw`` (uint8); ``None`` when it does not shrink by at least one page."""
    if element_bytes == 2 and raw.size % 2 == 0:
        codec, planes = Codec.ZSTD_SHUFFLE2, _shuffle(raw)
    else:
        codec, planes = Codec.ZSTD, raw
    packed = _compressor().compress(planes.data)
    if len(packed) + 4096 > raw.size:
        return None
    return codec, packed


def decode(codec: Codec, payload: bytes | memoryview, out: np.ndarray) -> None:
    """Decode ``payload`` into ``out`` (uint8, exactly the raw length); ``ValueError`` if bad.

    Hostile input (a slot planted in a cache directory, or another writer's) never costs
    more than ``out.size`` bytes of memory: a frame whose header declares any other size is
    refused before it is decoded (zstd decodes such a frame to its declared size whatever
    ``max_output_size`` says), and one that declares none stops at ``out.size`` bytes.
    """
    if codec not in (Codec.ZSTD, Codec.ZSTD_SHUFFLE2):
        raise ValueError(f"codec {codec!r} is not a compressed codec")
    try:
        declared = zstandard.frame_content_size(payload)  # -1: the header does not say
        if declared not in (-1, out.size):
            raise ValueError(f"zstd frame declares {declared} bytes, expected {out.size}")
        planes = _decompressor().decompress(payload, max_output_size=out.size)
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd payload does not decode: {exc}") from exc
    except MemoryError as exc:  # not even out.size bytes to be had: a miss, never a crash
        raise ValueError(f"zstd payload of {out.size} bytes could not be decoded: "
                         "out of memory") from exc
    if len(planes) != out.size:
        raise ValueError(f"decoded {len(planes)} bytes, expected {out.size}")
    flat = np.frombuffer(planes, dtype=np.uint8)
    if codec is Codec.ZSTD_SHUFFLE2:
        _unshuffle(flat, out)
    else:
        out[:] = flat
