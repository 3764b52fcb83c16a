"""Reading some parts of chunks from Mooncake Store (a hybrid model's chunks in parts,
``values.ValueFormat``): one ``get_into_ranges`` call moves each value's header (with its
part table) into a registered scratch area and the runs of parts a load fills straight into
their places in the chunks' registered host slots; each part read is then checked against
the table."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.remote.mooncake_client import GONE, INVALID_PARAMS, code_name
from kvtier.remote.values import ValueFormat


def read_ranges(client: Any, form: ValueFormat, names: Sequence[str], keys: Sequence[ChunkKey],
                outs: Sequence[np.ndarray], wanted: Sequence[Collection[int]],
                headers: np.ndarray) -> list[list[int]]:
    """Bytes read (or an error code) for each range of each chunk: the header first, then
    each run of parts ``wanted``. ``outs``: each chunk's bytes (``uint8``, in registered
    memory); ``headers``: registered scratch of ``len(names) * form.header_bytes``."""
    runs = [form.ranges(w) for w in wanted]
    hb = form.header_bytes
    answers = client.get_into_ranges(
        [headers.ctypes.data] + [out.ctypes.data for out in outs],
        [list(names)] + [[name] for name in names],
        [[[i * hb] for i in range(len(names))]] + [[[a for a, _ in r]] for r in runs],
        [[[0]] * len(names)] + [[[hb + a for a, _ in r]] for r in runs],
        [[[hb]] * len(names)] + [[[e - a for a, e in r]] for r in runs])
    return [[answers[0][i][0], *answers[1 + i][0]] for i in range(len(names))]


def outcomes(form: ValueFormat, keys: Sequence[ChunkKey], codes: Sequence[Sequence[int]],
             headers: np.ndarray, outs: Sequence[np.ndarray],
             wanted: Sequence[Collection[int]]) -> list[IOResult]:
    """Each chunk's ``outcome``, its header read into its place in ``headers``."""
    hb = form.header_bytes
    return [outcome(form, key, chunk, headers[i * hb:(i + 1) * hb], out, parts, GONE)
            for i, (key, chunk, out, parts) in enumerate(zip(keys, codes, outs, wanted, strict=True))]


def outcome(form: ValueFormat, key: ChunkKey, codes: Sequence[int], header: np.ndarray,
            out: np.ndarray, wanted: Collection[int], gone: Collection[int]) -> IOResult:
    """What a chunk's range reads (``codes``, as ``read_ranges`` gives them) come to."""
    expected = [form.header_bytes] + [e - a for a, e in form.ranges(wanted)]
    if list(codes) == expected:
        problem = form.parts_problem(header.data, out[:form.raw_bytes], key, wanted)
        return IOResult(IOStatus.CORRUPT, 0, problem) if problem \
            else IOResult(IOStatus.OK, sum(expected[1:]))
    if codes[0] in gone:
        return IOResult(IOStatus.MISSING)
    bad = next(c for c, n in zip(codes, expected, strict=True) if c != n)
    if bad >= 0 or bad == INVALID_PARAMS:  # a range past the value's end: a shorter value
        return IOResult(IOStatus.CORRUPT, 0, f"a range read {bad} of {expected}: not this layout")
    if bad in gone:
        return IOResult(IOStatus.MISSING)
    return IOResult(IOStatus.IO_ERROR, 0, f"get: {code_name(bad)}")
