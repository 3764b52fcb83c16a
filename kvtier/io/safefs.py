"""Entries under a cache root, handled as hostile: the one place kvtier opens them.

A cache root may sit on a filesystem that other users and other engines write, so every
entry below it is untrusted. The rule, applied here and nowhere else:

- a directory is opened by descriptor (``O_DIRECTORY | O_NOFOLLOW``) and checked with
  ``fstat``: a real directory, owned by this user, not world-writable;
- everything inside it is opened relative to that descriptor with ``O_NOFOLLOW`` (a symlink
  is refused, never followed) and ``O_NONBLOCK`` (a FIFO never blocks the open), then checked
  with ``fstat`` to be a regular file of this user with one link before it is read, written
  or deleted;
- reads of metadata are bounded by size before anything is parsed;
- names are plain names chosen by kvtier, never taken from key material.

Anything that breaks the rule raises :class:`UnsafeEntry` (an ``OSError``, errno ``EPERM``
unless the cause has its own) whose message names the entry and what is wrong with it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import secrets
import stat
from collections.abc import Callable
from functools import partial

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = {stat.S_IFLNK: "a symlink", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFDIR: "a directory", stat.S_IFREG: "a regular file"}


class CacheDirError(OSError):
    """A cache directory that must not be used; the message says why and what to do."""


class UnsafeEntry(CacheDirError):
    """An entry under a cache root that breaks the hostile-directory rule."""


def write_all(fd: int, data: bytes | memoryview, offset: int | None = None) -> None:
    """Write all of ``data`` (at ``offset``, or at the file position), call after call: a
    short count goes on, so a full disk fails with its own ENOSPC, never as a short write."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        chunk = view[done:done + (1 << 30)]  # one write moves at most 2 GiB - 4 KiB on Linux
        n = os.write(fd, chunk) if offset is None else os.pwrite(fd, chunk, offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "a write returned no bytes")
        done += n


def kind_of(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ValueError(f"not a plain file name: {name!r}")


def _check_dir(info: os.stat_result, where: str) -> None:
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeEntry(errno.ENOTDIR, f"{where} is {kind_of(info.st_mode)}, not a directory")
    if info.st_uid != os.geteuid():
        raise UnsafeEntry(errno.EPERM, f"{where} belongs to uid {info.st_uid}, not to this "
                          f"process (uid {os.geteuid()}); kvtier uses only its own directories")
    if info.st_mode & stat.S_IWOTH:
        raise UnsafeEntry(errno.EPERM, f"{where} is world-writable (mode "
                          f"{stat.S_IMODE(info.st_mode):o}); use a private directory (0700)")


def check_file(fd: int, where: str) -> os.stat_result:
    """``fstat`` of an open file that must be a regular file of this user with one link."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeEntry(errno.EPERM, f"{where} is {kind_of(info.st_mode)}, not a regular "
                          "file; kvtier never made it: remove it")
    if info.st_uid != os.geteuid():
        raise UnsafeEntry(errno.EPERM, f"{where} belongs to uid {info.st_uid}, not to this "
                          f"process (uid {os.geteuid()}); kvtier never made it: remove it")
    if info.st_nlink > 1:
        raise UnsafeEntry(errno.EPERM, f"{where} has {info.st_nlink} hard links; kvtier never "
                          "makes one: remove it")
    return info


class SafeDir:
    """A directory held open by descriptor; see the module docstring for what is checked.

    ``path`` is for messages only: every operation goes through the descriptor, so the
    directory cannot be swapped for a symlink or another directory once opened.
    """

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> SafeDir:
        """Open a cache root (a ``disk_paths`` entry): its last component must not be a
        symlink. Raises ``CacheDirError`` saying what to fix."""
        path = os.fspath(path)
        if not path:
            raise CacheDirError(errno.ENOENT, "the cache path is empty; name a directory")
        try:
            fd = os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            raise CacheDirError(errno.ENOENT, f"cache path {path} does not exist; create it "
                                "(mode 0700) or fix disk_paths") from None
        except OSError as exc:
            raise _refused(path, exc, partial(os.lstat, path)) from None
        return cls._checked(fd, path)

    @classmethod
    def _checked(cls, fd: int, path: str) -> SafeDir:
        try:
            _check_dir(os.fstat(fd), path)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    def _where(self, name: str) -> str:
        return os.path.join(self.path, name)

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry itself (a symlink is not followed); None when missing."""
        _check_name(name)
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def listed(self, limit: int) -> list[str]:
        """Entry names, sorted; ``UnsafeEntry`` (E2BIG) past ``limit``, kvtier's most there
        (the listing stops: a directory stuffed with entries costs ``limit`` of them)."""
        names = self.scan(limit + 1)
        if len(names) > limit:
            raise UnsafeEntry(errno.E2BIG, f"{self.path} holds more than {limit} entries, more "
                              "than kvtier ever makes there: remove those it did not make")
        return sorted(names)

    def scan(self, limit: int) -> list[str]:
        """At most ``limit`` entry names, in the directory's own order: the listing stops
        there, so a directory stuffed with entries costs no more than ``limit`` of them."""
        with os.scandir(self.fd) as entries:
            return [entry.name for entry in itertools.islice(entries, limit)]

    def subdir(self, name: str, *, create: bool = False) -> SafeDir:
        """Open (``create``: first make, mode 0700) the subdirectory ``name``."""
        _check_name(name)
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=self.fd)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            raise _refused(self._where(name), exc, partial(os.lstat, name, dir_fd=self.fd)) from None
        return SafeDir._checked(fd, self._where(name))

    def open_file(self, name: str, flags: int, *, create: bool = False) -> int:
        """A descriptor of the regular file ``name`` (``create``: made 0600 when missing),
        opened with ``flags`` (``O_RDONLY``, ``O_RDWR``, ``O_DIRECT``...)."""
        _check_name(name)
        flags |= _FILE_FLAGS | (os.O_CREAT if create else 0)
        try:
            fd = os.open(name, flags, 0o600, dir_fd=self.fd)
        except OSError as exc:
            raise _refused(self._where(name), exc) from None
        try:
            check_file(fd, self._where(name))
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_file(self, name: str, limit: int) -> bytes | None:
        """The whole of file ``name`` if it is at most ``limit`` bytes; None when missing;
        ``UnsafeEntry`` (EFBIG) when larger."""
        try:
            fd = self.open_file(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise UnsafeEntry(errno.EFBIG, f"{self._where(name)} is {size} bytes, more "
                                  f"than the {limit} kvtier ever writes there")
            return read_at(fd, size, 0)
        finally:
            os.close(fd)

    def replace_file(self, name: str, data: bytes) -> None:
        """Make ``name`` hold ``data``, atomically: written to a new file, then renamed over
        the old entry (a symlink there is replaced, never followed)."""
        temp = f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"  # unique across hosts too
        self.remove_file(temp)
        fd = self.open_file(temp, os.O_WRONLY | os.O_EXCL, create=True)
        try:
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
            os.rename(temp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:  # a full disk: no temporary file left behind, beat after beat
            with contextlib.suppress(OSError):
                self.remove_file(temp)
            raise

    def remove_file(self, name: str, links: int = 1) -> bool:
        """Unlink ``name`` only if it is a regular file of this user with at most ``links``
        hard links; False when missing; ``UnsafeEntry`` when it is anything else (then it is
        left alone). kvtier makes a second link only for a moment (``write_seat``): a file
        with more may be linked from outside the cache root, so it is not provably kvtier's."""
        info = self.lstat(name)
        if info is None:
            return False
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise UnsafeEntry(errno.EPERM, f"{self._where(name)} is {kind_of(info.st_mode)} "
                              f"of uid {info.st_uid}; kvtier did not make it and leaves it alone")
        if info.st_nlink > links:
            raise UnsafeEntry(errno.EPERM, f"{self._where(name)} has {info.st_nlink} hard "
                              "links; kvtier did not make them and leaves it alone")
        os.unlink(name, dir_fd=self.fd)
        return True

    def remove_dir(self, name: str) -> bool:
        """Remove the empty subdirectory ``name``; False when it is not empty."""
        _check_name(name)
        try:
            os.rmdir(name, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise
        return True

    def inode(self) -> int:
        return os.fstat(self.fd).st_ino

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafeDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_at(fd: int, length: int, offset: int) -> bytes:
    """Up to ``length`` bytes at ``offset`` (fewer at the end of the file)."""
    parts, got = [], 0
    while got < length:
        part = os.pread(fd, min(length - got, 1 << 24), offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _refused(where: str, exc: OSError,
             lstat: Callable[[], os.stat_result] | None = None) -> OSError:
    """The error for an entry that could not be opened: ``UnsafeEntry`` for a symlink or a
    non-directory, the original error (with the path) otherwise. ``lstat`` tells a symlink
    to a directory (refused as not a directory, ``ENOTDIR``) from a file."""
    if exc.errno == errno.ENOTDIR and lstat is not None and _is_link(lstat):
        exc = OSError(errno.ELOOP, exc.strerror)
    if exc.errno == errno.ELOOP:
        return UnsafeEntry(errno.ELOOP, f"{where} is a symlink; kvtier never follows one: "
                           "name the real directory, or remove the link")
    if exc.errno == errno.ENOTDIR:
        return UnsafeEntry(errno.ENOTDIR, f"{where} is not a directory")
    if exc.errno == errno.EISDIR:
        return UnsafeEntry(errno.EPERM, f"{where} is a directory, not a regular file; kvtier "
                           "never made it: remove it")
    if exc.errno == errno.ENXIO:
        return UnsafeEntry(errno.EPERM, f"{where} is a special file; remove it")
    return type(exc)(exc.errno, f"{where}: {exc.strerror}")


def _is_link(lstat: Callable[[], os.stat_result]) -> bool:
    try:
        return stat.S_ISLNK(lstat().st_mode)
    except OSError:
        return False
