"""A whole value in Mooncake Store as two pieces, header and payload (``values.ValueFormat``):
a put's pieces filled from the chunks, what a get of the pieces answers for a chunk, and
what is done after a get."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.remote.mooncake_client import GONE, INVALID_PARAMS, TRANSFER_FAIL, code_name
from kvtier.remote.values import ValueFormat


def fill_pieces(form: ValueFormat, keys: Sequence[ChunkKey], raws: Sequence[np.ndarray],
                headers: Sequence[np.ndarray], payloads: Sequence[np.ndarray],
                staged: Sequence[bool]) -> None:
    """Each chunk's header into its header piece, and its bytes (``raws``) into its payload
    piece where that is a scratch (``staged``) rather than the chunk's own bytes."""
    for key, raw, header, payload, copy in zip(keys, raws, headers, payloads, staged, strict=True):
        if copy:
            payload[:] = raw
        header[:] = np.frombuffer(form.header(key, raw), np.uint8)


def get_result(form: ValueFormat, client: Any, name: str, key: ChunkKey, code: int,
               header: np.ndarray, payload: np.ndarray) -> IOResult:
    """What a get's answer ``code`` (bytes read, or an error) means for one chunk."""
    expected = form.header_bytes + form.raw_bytes
    if code == expected:
        problem = form.problem(header.data, payload.data, key)
        if problem:
            return IOResult(IOStatus.CORRUPT, 0, problem)
        return IOResult(IOStatus.OK, form.raw_bytes)
    if code in GONE:
        return IOResult(IOStatus.MISSING)
    if code >= 0 or code in (INVALID_PARAMS, TRANSFER_FAIL):  # a value of another size?
        size = client.get_size(name) if code < 0 else code
        if size >= 0 and size != expected:
            return IOResult(IOStatus.CORRUPT, 0, f"value of {size} bytes, expected {expected}")
        if size in GONE:
            return IOResult(IOStatus.MISSING)
    return IOResult(IOStatus.IO_ERROR, 0, f"get: {code_name(code)}")


def settle(client: Any, names: Sequence[str], results: Sequence[IOResult]) -> None:
    """After a get: values that failed their checks are removed, so that the next put stores
    a good one."""
    bad = [name for name, r in zip(names, results, strict=True) if r.status is IOStatus.CORRUPT]
    if bad:
        client.batch_remove(bad, True)
