"""A mount whose file system never answers, standing for an NFS server down under a hard
mount, an NVMe-oF target gone, or a FUSE daemon stopped: a FUSE mount whose daemon is this
process, which never reads its requests. Every call on a path under it waits until the
mount's device is closed (``release``: the calls then fail with ENOTCONN), or for ever.
Root only, and only in a mount namespace of its own (``unshare -m``): the mount must not
outlive the test."""

from __future__ import annotations

import ctypes
import json
import os
import select
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

MNT_DETACH = 2
ROOT = Path(__file__).resolve().parents[2]


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


FUSE_STATFS, FUSE_INIT, FUSE_OPENDIR, FUSE_RELEASEDIR = 17, 26, 27, 29
IN_HEADER = struct.Struct("<IIQQIIIHH")  # fuse_in_header: len, opcode, unique, nodeid, ...
OUT_HEADER = struct.Struct("<IiQ")  # fuse_out_header: len, error, unique
INIT_IN = struct.Struct("<IIII")  # fuse_init_in, its start: major, minor, max_readahead, flags
INIT_OUT = struct.Struct("<IIIIHHIIHH32x")  # fuse_init_out, no feature asked (64 bytes)
STATFS_OUT = struct.Struct("<QQQQQIIII24x")  # fuse_kstatfs (80 bytes)
OPEN_OUT = struct.Struct("<QIi")  # fuse_open_out: fh, open_flags, backing_id


class StatfsOnly:
    """A FUSE mount at ``where`` whose daemon (a thread of this process) answers the
    kernel's first message and every ``statfs`` (and, ``top``, every open and close of its
    top directory), and nothing else: a file system that answers its statistics, then
    holds every other call for ever, as a FUSE daemon whose back end hung does
    (``kvtier.io.answers`` asks both: without ``top`` it does not answer; with it, it
    answers and then holds whatever looks further). ``release`` ends it (the calls held
    fail) and takes the mount away."""

    def __init__(self, where: str, top: bool = False) -> None:
        self.where, self.top = where, top
        self.device = hang(where)
        self._stop_r, self._stop_w = os.pipe()
        self.statfs = 0  # statfs answered
        self._thread = threading.Thread(target=self._serve, name="statfs-only", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while self._stop_r not in select.select([self.device, self._stop_r], [], [])[0]:
                message = os.read(self.device, 1 << 20)
                _, opcode, unique = IN_HEADER.unpack_from(message)[:3]
                if opcode == FUSE_INIT:
                    _, minor, readahead, _ = INIT_IN.unpack_from(message, IN_HEADER.size)
                    self._reply(unique, INIT_OUT.pack(7, minor, readahead, 0, 16, 12, 4096, 1, 1, 0))
                elif opcode == FUSE_STATFS:
                    self.statfs += 1
                    self._reply(unique, STATFS_OUT.pack(1 << 20, 1 << 19, 1 << 19, 1024, 512,
                                                        4096, 255, 4096, 0))
                elif self.top and opcode == FUSE_OPENDIR:
                    self._reply(unique, OPEN_OUT.pack(1, 0, 0))
                elif self.top and opcode == FUSE_RELEASEDIR:
                    self._reply(unique, b"")
        finally:
            os.close(self.device)  # (the only holder: its release ends every call held)

    def _reply(self, unique: int, body: bytes) -> None:
        os.write(self.device, OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique) + body)

    def release(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(10)
        ctypes.CDLL(None, use_errno=True).umount2(os.fsencode(self.where), MNT_DETACH)


def unshared(script: str, *args: str, timeout: int) -> dict:
    """Run ``script`` with ``args`` in a private mount namespace of its own; the JSON it
    printed last (skipped where this machine cannot mount)."""
    run = subprocess.run(["unshare", "-m", "--propagation", "private", "--", sys.executable, "-c",
                          script, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    skip_without_mounts(run)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def skip_without_mounts(run: subprocess.CompletedProcess) -> None:
    """Skip where this machine gives no private mount namespace or FUSE mount (a container
    without the right to mount)."""
    if run.returncode != 0 and ("Operation not permitted" in run.stderr[-2000:]
                                or "cannot mount a FUSE" in run.stderr):
        pytest.skip(f"no private FUSE mount here: {run.stderr.strip()[-200:]}")


def fuse_dirs(tmp_path: Path) -> tuple[Path, Path]:
    """Two empty directories, ``good`` and ``hung`` (for a FUSE mount), where this machine
    can mount one in a namespace of its own (skipped elsewhere)."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root, unshare and /dev/fuse for a FUSE mount that never answers")
    good, hung = tmp_path / "good", tmp_path / "hung"
    good.mkdir(mode=0o700)
    hung.mkdir(mode=0o700)
    return good, hung
