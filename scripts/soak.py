"""Soak: a store under mixed load while faults are injected; prints what happened.

    python scripts/soak.py --minutes 3 [--dir DIR] [--json out/soak.json]

Several threads put and get overlapping prefixes through a KVStore with a small host tier and
a disk tier, and check every byte they get back. Meanwhile faults are injected: bytes flipped
in the slot files, slot files truncated, I/O errors and slow I/O from a wrapper around
preadv/pwritev, and, between phases, a second process writing to the same directory killed
with SIGKILL before the store is reopened. A path taken out of service by an EIO burst is tried
again after 2 s (``disk_retry``; 30 s by default); I/O calls that take 1.5 s stand for a hung
drive, given up on after 1 s (``load_timeout``). Phases alternate write-through and
write-back (where putting a chunk may first have to write an evicted one to disk). Reported:
operations, hits, faults injected by kind, exceptions that escaped (must be 0), wrong bytes
served (must be 0), and the drift of open file descriptors and resident memory from the
first phase to the last.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from kvtier import KVLayout, KVStore

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_size=64, dtype="bfloat16")
CHUNK = 32


def config(path: Path, write_policy: str = "write_through") -> dict:
    return {"chunk_tokens": CHUNK, "host_capacity": 24 * LAYOUT.token_bytes * CHUNK,
            "disk_paths": [str(path)], "disk_capacity": 200 * (4096 + LAYOUT.token_bytes * CHUNK),
            "disk_min_free": 0, "io_threads": 4, "disk_retry": "2s", "load_timeout": "1s",
            "write_policy": write_policy, "model": "soak-model"}


def expected_kv(tokens) -> torch.Tensor:
    """KV that is a pure function of the whole prefix of each position."""
    tokens = np.asarray(tokens, dtype=np.int64)
    prefix = np.cumsum(tokens * 2654435761 % 65521) % 65521
    lane = np.arange(LAYOUT.hidden)[None, None, None, :]
    values = prefix[None, None, :, None] * 31 + lane + np.arange(2)[None, :, None, None] * 7 \
        + np.arange(LAYOUT.num_layers)[:, None, None, None] * 13
    return torch.from_numpy((values % 32749).astype(np.int16)).view(torch.bfloat16)


def sequence(rng: random.Random) -> list[int]:
    family = rng.randrange(12)
    base = list(range(family * 100_000, family * 100_000 + 2 * CHUNK))
    return base + [rng.randrange(4) for _ in range(rng.randrange(4) * CHUNK)]


class Faults:
    """I/O faults through a wrapper around os.preadv/os.pwritev, switched on and off."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self._real = {name: getattr(os, name) for name in ("preadv", "pwritev")}
        for name in self._real:
            setattr(os, name, self._wrap(name))

    def _wrap(self, name: str):
        real = self._real[name]

        def call(fd, *args):
            if self.mode is not None and "slots-" in os.readlink(f"/proc/self/fd/{fd}"):
                if self.mode == "eio":
                    raise OSError(errno.EIO, "injected I/O error")
                time.sleep(1.5 if self.mode == "hang" else 0.02)  # a hung drive, or slow I/O
            return real(fd, *args)

        return call


def worker(store: KVStore, stop: threading.Event, seed: int, counts: Counter, lock) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        tokens = sequence(rng)
        try:
            if rng.random() < 0.4:
                store.put(tokens, expected_kv(tokens))
                with lock:
                    counts["puts"] += 1
                continue
            out = torch.zeros(LAYOUT.shape(len(tokens)), dtype=torch.bfloat16)
            n = store.get(tokens, out)
            want = expected_kv(tokens)[:, :, :n]
            good = torch.equal(out[:, :, :n].view(torch.int16), want.view(torch.int16))
            with lock:
                counts["gets"] += 1
                counts["hit_tokens"] += n
                counts["wrong_bytes_served"] += 0 if good else 1
        except Exception as exc:  # must not happen: counted and shown
            with lock:
                counts["escaped_exceptions"] += 1
                counts[f"exception {type(exc).__name__}: {exc}"[:120]] += 1


def inject(path: Path, faults: Faults, stop: threading.Event, seed: int, counts: Counter, lock) -> None:
    rng = random.Random(seed)
    while not stop.wait(0.3):
        kind = rng.choice(["flip", "flip", "truncate", "eio", "slow", "hang"])
        # every writer's slot files, wherever the layout puts them (<namespace>/writers/<id>/)
        files = [f for f in path.rglob("slots-*.kvt") if f.is_file() and not f.is_symlink()]
        if kind in ("flip", "truncate"):
            if not files:
                continue  # nothing to corrupt yet: no fault, none counted
            target = rng.choice(files)
            size = target.stat().st_size
            if size == 0:
                continue
            with open(target, "r+b") as f:
                if kind == "flip":
                    f.seek(rng.randrange(size))
                    byte = f.read(1)
                    f.seek(f.tell() - 1)
                    f.write(bytes([byte[0] ^ 0xFF]))
                else:
                    f.truncate(rng.randrange(size))
        elif kind in ("eio", "slow", "hang"):
            faults.mode = kind
            time.sleep(0.15)
            faults.mode = None
        with lock:
            counts[f"fault {kind}"] += 1


def kill_a_writer(path: Path, rng: random.Random) -> None:
    """A second process writing to the directory, killed with SIGKILL mid-way."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "import random; from soak import *\n"
            f"s = KVStore(LAYOUT, config(Path({str(path)!r}))); r = random.Random(1)\n"
            "while True:\n    t = sequence(r); s.put(t, expected_kv(t))\n")
    child = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.5 + rng.random())
    os.kill(child.pid, signal.SIGKILL)
    child.wait()


def resident_mib() -> float:
    """This process's resident memory now (VmRSS), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    path = args.dir or Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    faults, counts, lock = Faults(), Counter[str](), threading.Lock()
    rng = random.Random(0)
    deadline = time.monotonic() + 60 * args.minutes
    phase_s = min(15.0, 30 * args.minutes)  # two phases at least: both write policies
    samples = []
    phase = 0
    while time.monotonic() < deadline:
        policy = ("write_through", "write_back")[phase % 2]
        store = KVStore(LAYOUT, config(path, policy))
        counts[f"phases {policy}"] += 1
        counts["restarts"] += 1
        counts["recovered_chunks"] += store.stats().recovered_chunks
        stop = threading.Event()
        threads = [threading.Thread(target=worker, args=(store, stop, phase * 100 + i, counts, lock))
                   for i in range(args.threads)]
        threads.append(threading.Thread(target=inject, args=(path, faults, stop, phase, counts, lock)))
        for t in threads:
            t.start()
        time.sleep(min(phase_s, max(1.0, deadline - time.monotonic())))
        stop.set()
        for t in threads:
            t.join()
        faults.mode = None
        stats = store.stats()
        for name in ("corruptions", "io_errors", "no_space", "dropped_writes", "load_timeouts"):
            counts[f"counted {name}"] += getattr(stats, name)
        counts["paths_down at phase end"] += len(stats.paths_down)
        counts["paths back in service"] += stats.paths_back
        store.close()
        samples.append({"fds": len(os.listdir("/proc/self/fd")), "rss_mib": resident_mib()})
        kill_a_writer(path, rng)
        counts["fault kill -9 of a writer"] += 1
        phase += 1
    result = {"minutes": args.minutes, "threads": args.threads, "phases": phase,
              "counts": dict(counts), "fd_drift": samples[-1]["fds"] - samples[0]["fds"],
              "rss_drift_mib": samples[-1]["rss_mib"] - samples[0]["rss_mib"],
              "samples": samples}
    for key in sorted(counts):
        print(f"{key:40s} {counts[key]}")
    print(f"{'phases':40s} {phase}")
    print(f"{'open fd drift (first to last phase)':40s} {result['fd_drift']}")
    print(f"{'resident memory drift, MiB':40s} {result['rss_drift_mib']:.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    bad = counts["wrong_bytes_served"] or counts["escaped_exceptions"]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
