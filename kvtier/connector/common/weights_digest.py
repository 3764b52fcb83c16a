"""A fingerprint of a local model's weights, so that weights replaced in place (a fine-tune
copied over the old files, a model directory updated under one path) name another namespace
and never load the KV the old weights computed.

Reading every byte of the weights would cost as much as loading them, so each weight file is
named by its name, its size and ``SAMPLES`` blocks of ``SAMPLE_BYTES`` read at offsets spread
evenly from its first byte to its last. Training changes nearly every weight it touches, so
any new weights change some sample; a change confined to bytes between the samples (a few
values edited by hand) is not seen. Every process of an engine, and every replica holding
the same bytes, reads the same samples: copies of one model on several machines share their
namespace whatever their files' times.

The model directory is the engine's own (vLLM reads it anyway), not a cache root: symbolic
links are followed (a hub cache's snapshot is links to blobs), but only regular files are
read, each opened without blocking, and at most ``MAX_FILES`` of them.
"""

from __future__ import annotations

import hashlib
import os
import stat

SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5", ".tensors")
SAMPLES, SAMPLE_BYTES = 64, 4096  # per file: 256 KiB read
MAX_FILES = 4096  # weight files looked at, in name order; the rest named by name only


def weights_digest(directory: str) -> str | None:
    """A digest (hex) of the weight files directly in ``directory`` (or of the file
    ``directory`` names: a GGUF model given as one file); None where it holds none or
    cannot be listed (a hub model's name: its ``revision`` names it)."""
    if os.path.isfile(directory):
        directory, names = os.path.split(directory)[0] or ".", [os.path.basename(directory)]
    else:
        try:
            names = sorted(name for name in os.listdir(directory) if name.endswith(SUFFIXES))
        except OSError:
            return None
    if not names:
        return None
    digest = hashlib.blake2b(digest_size=8, person=b"kvtier-weights")
    for index, name in enumerate(names):
        digest.update(name.encode(errors="surrogateescape") + b"\0")
        if index < MAX_FILES:
            digest.update(_file_fingerprint(os.path.join(directory, name)))
    return digest.hexdigest()


def _file_fingerprint(path: str) -> bytes:
    """The file's size and its samples; b"?" where it is not a regular file or unreadable
    (the same answer in every process, so the namespace still agrees)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return b"?"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return b"?"
        size = info.st_size
        out = [size.to_bytes(8, "little")]
        for offset in sample_offsets(size):
            out.append(os.pread(fd, SAMPLE_BYTES, offset))
        return b"".join(out)
    except OSError:
        return b"?"
    finally:
        os.close(fd)


def sample_offsets(size: int) -> list[int]:
    """Where the samples of a file of ``size`` bytes start: the first block, the last, and
    evenly between (the whole file, once, where it is small)."""
    if size <= SAMPLES * SAMPLE_BYTES:
        return list(range(0, size, SAMPLE_BYTES))
    last = size - SAMPLE_BYTES
    return [last * i // (SAMPLES - 1) for i in range(SAMPLES)]
