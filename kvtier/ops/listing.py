"""The offline commands' listings of a cache root's directories, each bounded.

A cache root may sit on a shared filesystem that a hostile or broken co-writer fills: a
directory stuffed with millions of entries must cost a command no more than a bounded
listing. Every directory the offline commands list is listed here, up to its bound
(``SafeDir.listed``: the listing stops one entry past it), and past the bound the listing
raises ``UnsafeEntry`` (errno ``E2BIG``) naming the directory and the bound. Each caller
turns that into the report it gives for a directory it cannot use (the directory skipped, the
reason shown, exit 1), as it does for a symlink there; nothing in such a directory is changed.
The bounds are read at each call, so tests set them low rather than make huge directories.
"""

from __future__ import annotations

from kvtier.io.safefs import SafeDir
from kvtier.segment.names import SEATS_LISTED, SEGMENT_LISTED

# A cache root: a directory per namespace (one per model, KV dtype, layout, chunk size, TP/PP
# rank and format version that ever used the path) and whatever else lies there.
ROOT_LISTED = 65536
# ``writers/``: one segment per writer id a namespace ever had (default ids, ``<host>-<n>``,
# are reused by each host's processes; an ``instance_id`` per process is not): at most
# ``share_writers`` (4096 at most) hold seats, and the segments of writers gone that no
# reader reclaimed yet, or that hold files kvtier did not make, stay: 16 times the seats.
WRITERS_LISTED = 16 * 4096
# A namespace directory holds a handful of kvtier's entries; one of format version 1 holds
# its slot files as a segment does.
NAMESPACE_LISTED = SEGMENT_LISTED

__all__ = ["NAMESPACE_LISTED", "ROOT_LISTED", "SEATS_LISTED", "SEGMENT_LISTED", "WRITERS_LISTED",
           "namespace_names", "root_names", "seat_names", "segment_names", "writer_names"]


def root_names(root: SafeDir) -> list[str]:
    """The entries of a cache root, sorted; ``UnsafeEntry`` past ``ROOT_LISTED``."""
    return root.listed(ROOT_LISTED)


def namespace_names(directory: SafeDir) -> list[str]:
    """The entries of a namespace directory; ``UnsafeEntry`` past ``NAMESPACE_LISTED``."""
    return directory.listed(NAMESPACE_LISTED)


def writer_names(writers: SafeDir) -> list[str]:
    """The entries of a namespace's ``writers/``; ``UnsafeEntry`` past ``WRITERS_LISTED``."""
    return writers.listed(WRITERS_LISTED)


def seat_names(seats: SafeDir) -> list[str]:
    """The entries of a namespace's ``seats/``; ``UnsafeEntry`` past ``SEATS_LISTED`` (an
    engine's bound: past it, its path is refused)."""
    return seats.listed(SEATS_LISTED)


def segment_names(segment: SafeDir) -> list[str]:
    """The entries of a writer's segment; ``UnsafeEntry`` past ``SEGMENT_LISTED`` (an
    engine's bound: past it, its path is refused)."""
    return segment.listed(SEGMENT_LISTED)
