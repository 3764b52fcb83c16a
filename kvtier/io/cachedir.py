"""One namespace's directory on one disk path: safe to open, locked, and its slot files.

Layout: ``<disk_path>/<namespace id>/`` (mode 0700) holding ``namespace.json`` (what the
namespace is, for the CLI), ``lock`` (held with ``flock`` by the process using it),
``slots-NNNN.kvt`` files (mode 0600) of fixed-size slots, and ``index.kvt``: a copy of each
slot's header, 128 bytes per slot, written after the slot, so that start-up reads one small
file instead of every slot's header. The slot's own header stays the truth: every read
checks it. Files grow in large preallocated
steps, never past the capacity, and never below the filesystem's free-space floor.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import threading
from pathlib import Path

import numpy as np

from kvtier.config import DiskFloor
from kvtier.io.buffers import PAGE, AlignedBuffer
from kvtier.io.format import INDEX_ENTRY_BYTES

log = logging.getLogger(__name__)

GROW_BYTES = 256 * 1024**2
SLOT_FILE = "slots-{:04d}.kvt"
META_FILE = "namespace.json"
INDEX_FILE = "index.kvt"
LOCK_FILE = "lock"


class CacheDirError(OSError):
    """A cache directory that must not be used; the message says why and what to do."""


def floor_allows(floor: DiskFloor, path: str, grow: int) -> bool:
    """True when growing by ``grow`` bytes leaves the filesystem above ``floor``."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    return free - grow >= max(floor.bytes, int(floor.fraction * st.f_blocks * st.f_frsize))


def check_safe_dir(path: Path) -> None:
    """Refuse a symlink, a non-directory, a directory of another user or a world-writable one."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CacheDirError(errno.ENOENT, f"cache path {path} does not exist; create it "
                            "(mode 0700) or fix disk_paths") from None
    if stat.S_ISLNK(info.st_mode):
        raise CacheDirError(errno.ELOOP, f"cache path {path} is a symlink to {os.readlink(path)}; "
                            "name the real directory in disk_paths")
    if not stat.S_ISDIR(info.st_mode):
        raise CacheDirError(errno.ENOTDIR, f"cache path {path} is not a directory")
    if info.st_mode & stat.S_IWOTH:
        raise CacheDirError(errno.EPERM, f"cache path {path} is world-writable (mode "
                            f"{stat.S_IMODE(info.st_mode):o}); use a private directory (0700)")
    if info.st_uid != os.geteuid():
        raise CacheDirError(errno.EPERM, f"cache path {path} belongs to uid {info.st_uid}, not "
                            f"to this process (uid {os.geteuid()})")


def lock_namespace(directory: Path, advice: str) -> int:
    """Hold ``directory``'s lock file (``flock``, exclusive) and return its descriptor; raise
    ``CacheDirError`` (EBUSY) with ``advice`` when another process holds it."""
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CacheDirError(errno.EBUSY, f"{directory} is in use by another kvtier process; "
                            f"{advice}") from None
    return fd


def probe_o_direct(directory: Path) -> bool:
    """True when O_DIRECT writes and reads of one aligned page work in ``directory``."""
    probe = directory / ".o_direct_probe"
    buffer = AlignedBuffer(PAGE, pin=False)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        buffer.close()
        return False
    try:
        os.pwritev(fd, [buffer.array], 0)
        return os.preadv(fd, [buffer.array], 0) == PAGE
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
        buffer.close()


class CacheDir:
    """The slot files of one namespace on one disk path, opened and locked.

    ``stride`` bytes per slot, ``file_slots`` slots per file, ``num_slots`` in all. Raises
    :class:`CacheDirError` when the path is unsafe or another process holds the namespace.
    """

    def __init__(self, root: Path, namespace_id: str, meta: dict, *, num_slots: int,
                 stride: int, file_slots: int, o_direct: bool | None,
                 floor: DiskFloor) -> None:
        check_safe_dir(root)
        self.root = root
        self.path = root / namespace_id
        self.path.mkdir(mode=0o700, exist_ok=True)
        check_safe_dir(self.path)
        self._fds: dict[int, int] = {}
        self.index_fd = -1
        self.closed = False
        self._lock_fd = self._take_lock()
        try:  # anything failing from here on must not keep the namespace locked
            (self.path / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
            os.chmod(self.path / META_FILE, 0o600)
            probed = probe_o_direct(self.path)
            if o_direct and not probed:
                raise CacheDirError(errno.EINVAL, f"O_DIRECT does not work in {self.path}; set "
                                    "o_direct to auto or false")
            self.o_direct = probed if o_direct is None else o_direct
            self.num_slots, self.stride, self.file_slots = num_slots, stride, file_slots
            self.floor = floor
            self._sizes: dict[int, int] = {}
            self._grow_lock = threading.Lock()
            self._trim_extra_files()
            self.index_fd = os.open(self.path / INDEX_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        except BaseException:
            self.close()
            raise

    def _take_lock(self) -> int:
        return lock_namespace(self.path, "give each instance its own disk_paths")

    def slots_in_file(self, number: int) -> int:
        return max(0, min(self.file_slots, self.num_slots - number * self.file_slots))

    def _trim_extra_files(self) -> None:
        """Cut slot files down to the current capacity (after disk_capacity shrank)."""
        for path in self.path.glob("slots-*.kvt"):
            number = path.stem.split("-")[-1]
            if not number.isdigit():
                continue
            limit = self.slots_in_file(int(number)) * self.stride
            if limit == 0:
                path.unlink()
            elif path.stat().st_size > limit:
                os.truncate(path, limit)
        index = self.path / INDEX_FILE
        if index.exists() and index.stat().st_size > self.num_slots * INDEX_ENTRY_BYTES:
            os.truncate(index, self.num_slots * INDEX_ENTRY_BYTES)

    def write_index(self, local_slot: int, entry: np.ndarray) -> None:
        """Record a slot's header prefix (``INDEX_ENTRY_BYTES``) in the index file."""
        os.pwrite(self.index_fd, entry[:INDEX_ENTRY_BYTES], local_slot * INDEX_ENTRY_BYTES)

    def read_index(self) -> bytes:
        """The whole index file (empty when it was never written)."""
        size = os.fstat(self.index_fd).st_size
        return os.pread(self.index_fd, size, 0) if size else b""

    def locate(self, local_slot: int) -> tuple[int, int]:
        """(file number, byte offset) of a slot of this directory."""
        return divmod(local_slot, self.file_slots)[0], (local_slot % self.file_slots) * self.stride

    def fd(self, number: int) -> int:
        """The open descriptor of slot file ``number`` (created empty when missing); EBADF
        once closed (a request that outlived its path's take-down must not reopen files)."""
        fd = self._fds.get(number)
        if fd is None:
            with self._grow_lock:
                fd = self._fds.get(number)
                if self.closed:
                    raise OSError(errno.EBADF, f"{self.path} was closed")
                if fd is None:
                    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.o_direct else 0)
                    fd = os.open(self.path / SLOT_FILE.format(number), flags, 0o600)
                    self._sizes[number] = os.fstat(fd).st_size
                    self._fds[number] = fd
        return fd

    def file_size(self, number: int) -> int:
        self.fd(number)
        return self._sizes[number]

    def ensure_allocated(self, number: int, end: int) -> bool:
        """Make file ``number`` at least ``end`` bytes, preallocated; False below the floor."""
        if self._sizes.get(number, 0) >= end:
            return True
        fd = self.fd(number)
        with self._grow_lock:
            size = self._sizes[number]
            if size >= end:
                return True
            step = min(max(end, size + GROW_BYTES), self.slots_in_file(number) * self.stride)
            for target in dict.fromkeys((step, end)):  # a big step, else just what is needed
                if not floor_allows(self.floor, str(self.path), target - size):
                    continue
                try:
                    os.posix_fallocate(fd, size, target - size)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC or target == end:
                        raise
                    continue
                self._sizes[number] = target
                return True
            return False

    def close(self) -> None:
        self.closed = True
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self.index_fd >= 0:
            os.close(self.index_fd)
            self.index_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def aligned_view(buffer: np.ndarray, length: int) -> np.ndarray:
    """The first ``length`` bytes of ``buffer`` rounded up to a page (for O_DIRECT)."""
    return buffer[: -(-length // PAGE) * PAGE]
