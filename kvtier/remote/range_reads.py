"""Reading some parts of chunks in the remote store (a hybrid model's chunks in parts,
``values.ValueFormat``): which byte ranges of a value a read moves and into which buffers,
and what the replies come to, each part read checked against the value's part table."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from kvtier.io.result import IOResult, IOStatus
from kvtier.keys import ChunkKey
from kvtier.remote.resp import payload_view
from kvtier.remote.values import ValueFormat


def failed_answer(answer: str) -> IOResult:
    """A reply that is no value: CORRUPT when the key holds what kvtier did not write (a
    value of another length, a key of another type), so that it is written over; IO_ERROR
    otherwise (a redirect, a refusal), which says nothing of the value."""
    ours = not answer.startswith("wrong") and "WRONGTYPE" not in answer
    return IOResult(IOStatus.IO_ERROR if ours else IOStatus.CORRUPT, 0, f"get: {answer}")


class RangeRead:
    """A read of some parts of chunk ``key`` into their places in ``dst``: ``runs`` are the
    value's byte ranges ``[start, end)`` read (the header first, adjacent parts together),
    each with the buffers its bytes fill in turn."""

    def __init__(self, form: ValueFormat, key: ChunkKey, dst: np.ndarray,
                 wanted: Collection[int]) -> None:
        self.form, self.key, self.wanted = form, key, wanted
        self.payload = dst.reshape(-1).view(np.uint8)[:form.raw_bytes]
        self.header = memoryview(bytearray(form.header_bytes))
        at = form.header_bytes
        self.runs: list[tuple[int, int, list[memoryview]]] = [(0, at, [self.header])]
        for start, end in form.ranges(wanted):
            piece = payload_view(self.payload[start:end], end - start)
            if self.runs[-1][1] == at + start:
                first, _, views = self.runs[-1]
                self.runs[-1] = (first, at + end, [*views, piece])
            else:
                self.runs.append((at + start, at + end, [piece]))
        self.nbytes = sum(end - start for start, end in form.ranges(wanted))

    def outcome(self, answers: Sequence[str | None]) -> IOResult:
        """What the replies of ``runs`` (as ``BulkReplies.bulk_into`` answers) come to."""
        wrong = next((a for a in answers if a), None)
        if wrong is not None:  # an error, or a value of another length
            return failed_answer(wrong)
        if None in answers:  # not there, or evicted between the reads of its ranges
            return IOResult(IOStatus.MISSING)
        problem = self.form.parts_problem(self.header, self.payload, self.key, self.wanted)
        return IOResult(IOStatus.CORRUPT, 0, problem) if problem else IOResult(IOStatus.OK, self.nbytes)
