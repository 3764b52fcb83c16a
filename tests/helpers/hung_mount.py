"""A mount whose file system never answers, standing for an NFS server down under a hard
mount, an NVMe-oF target gone, or a FUSE daemon stopped: a FUSE mount whose daemon is this
process, which never reads its requests. Every call on a path under it waits until the
mount's device is closed (``release``: the calls then fail with ENOTCONN), or for ever.
Root only, and only in a mount namespace of its own (``unshare -m``): the mount must not
outlive the test."""

from __future__ import annotations

import ctypes
import os

MNT_DETACH = 2


def hang(where: str) -> int:
    """Mount a file system that never answers at ``where`` (an empty directory); return its
    device (close it with ``release``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    device = os.open("/dev/fuse", os.O_RDWR)
    options = f"fd={device},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()}"
    if libc.mount(b"kvtier-hung", os.fsencode(where), b"fuse", 0, options.encode()) != 0:
        code = ctypes.get_errno()
        os.close(device)
        raise OSError(code, f"cannot mount a FUSE file system at {where}: {os.strerror(code)}")
    return device


def mount_again(where: str) -> None:
    """Mount a file system that answers (a tmpfs, mode 0700) at ``where``: an operator's
    mount made anew where a hung one was taken away."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", os.fsencode(where), b"tmpfs", 0, b"mode=0700") != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot mount a tmpfs at {where}: {os.strerror(code)}")


def release(where: str, device: int) -> None:
    """End the hang (the calls waiting fail) and take the mount away (the directory under
    it shows again)."""
    os.close(device)
    ctypes.CDLL(None, use_errno=True).umount2(os.fsencode(where), MNT_DETACH)
