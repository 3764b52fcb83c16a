"""What every segment directory of a disk tier is opened with: ``OpenArgs``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtier.config.settings import DiskFloor
from kvtier.io.answers import wait_for_answer
from kvtier.segment.cachedir import CacheDir


@dataclass(frozen=True)
class OpenArgs:
    """What every ``CacheDir`` of a tier is opened with, besides its root and writer id:
    ``writers`` are the ids to try, in order, until one is free (one when configured)."""

    namespace_id: str
    writers: tuple[str, ...]
    meta: dict[str, object]
    num_slots: int
    stride: int
    file_slots: int
    o_direct: bool | None
    floor: DiskFloor
    share_writers: int = 1
    lease_timeout: float = 120.0  # stated in the lease, for readers configured otherwise
    answer_timeout: float | None = 10.0  # a root's file system must answer within it (load_timeout)

    def open(self, root: str, writer: str) -> tuple[CacheDir, int]:
        """``writer``'s segment at ``root``, opened with every check, and its inode; a
        ``TimeoutError`` when ``root``'s file system did not answer within
        ``answer_timeout`` (``kvtier.io.answers``: a hung mount), before anything is opened."""
        try:
            wait_for_answer(root, self.answer_timeout)
        except TimeoutError:
            raise
        except OSError:  # an answer: the open below says what is wrong, as the operator needs
            pass
        directory = CacheDir(Path(root), self.namespace_id, self.meta, writer=writer,
                             num_slots=self.num_slots,
                             stride=self.stride, file_slots=self.file_slots,
                             o_direct=self.o_direct, floor=self.floor,
                             share_writers=self.share_writers,
                             lease_timeout=self.lease_timeout)
        try:
            return directory, directory.inode
        except OSError:
            directory.close()
            raise
