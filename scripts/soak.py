"""Soak: a store under mixed load while faults are injected; prints what happened.

    python scripts/soak.py --minutes 3 [--dir DIR] [--json out/soak.json]
    python scripts/soak.py --minutes 3 --remote --shared    # a fleet's tiers too

Several threads put and get overlapping prefixes through a KVStore with a small host tier and
a disk tier, and check every byte they get back. Meanwhile faults are injected: bytes flipped
in the slot files, slot files truncated, I/O errors and slow I/O from a wrapper around
preadv/pwritev, and, between phases, a second process writing to the same directory killed
with SIGKILL before the store is reopened; and at each phase's end, a targeted flip: a byte of the
payload of a chunk just flushed, read back by a store opened anew (a miss, counted as a
corruption, never its bytes). A path taken out of service by an EIO burst is tried
again after 2 s (``disk_retry``; 30 s by default); I/O calls that take 1.5 s stand for a hung
drive, given up on after 1 s (``load_timeout``). Phases alternate write-through and
write-back (where putting a chunk may first have to write an evicted one to disk). Reported:
operations, hits, faults injected by kind, exceptions that escaped (must be 0), wrong bytes
served (must be 0), and the drift of open file descriptors and resident memory from the
first phase to the last.

With ``--remote`` a ``redis-server`` of its own on 127.0.0.1 (4 MiB of memory, so it evicts
all along) is the remote tier of the store and of a second store standing for another node
(host memory and the remote tier only, no disk), and the workers use both; faults then also
flip a byte of a value in the server, cut a value short, empty the server (``FLUSHALL``),
pause it for 1.5 s (``CLIENT PAUSE``: a hung store, past ``remote_timeout``) or kill it and
start it again. With ``--shared`` the directory is shared (``share_writers`` 3): a peer
process writes prompts of its own into its segment during each phase and is killed with
SIGKILL part-way, and the workers' gets ask for its prompts too (hits only from its segment),
so the faults in its slot files and its death mid-write land on reads of another writer's
chunks.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import queue
import random
import select
import shutil
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
from kvtier.io.format import HEADER_BYTES, HeaderError, decode_header

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests/
from tests.helpers.subprocesses import die_with_parent

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_size=64, dtype="bfloat16")
CHUNK = 32
FAMILIES = 12  # prompts the workers put and get
PEER_FAMILIES = range(FAMILIES, FAMILIES + 4)  # prompts only the peer writer puts (--shared)
REMOTE = {"remote_timeout": "500ms", "remote_retry": "1s"}
SHARED = {"share_writers": 3, "share_refresh": "250ms", "lease_timeout": "3s"}


def config(path: Path | None, write_policy: str = "write_through", remote: str | None = None,
           shared: bool = False, instance: str | None = None) -> dict:
    """The soak's store on ``path`` (None: host memory only, with ``remote``), with the
    remote tier at ``remote`` and a shared directory (``shared``: as writer ``instance``)."""
    cfg: dict = {"chunk_tokens": CHUNK, "host_capacity": 24 * LAYOUT.token_bytes * CHUNK,
                 "io_threads": 4, "load_timeout": "1s", "write_policy": write_policy,
                 "model": "soak-model"}
    if path is not None:
        cfg.update(disk_paths=[str(path)], disk_capacity=200 * (4096 + LAYOUT.token_bytes * CHUNK),
                   disk_min_free=0, disk_retry="2s")
    if remote is not None:
        cfg.update(remote_url=remote, **REMOTE)
    if shared and path is not None:
        cfg.update(SHARED, instance_id=instance)
    return cfg


def expected_kv(tokens) -> torch.Tensor:
    """KV that is a pure function of the whole prefix of each position."""
    tokens = np.asarray(tokens, dtype=np.int64)
    prefix = np.cumsum(tokens * 2654435761 % 65521) % 65521
    lane = np.arange(LAYOUT.hidden)[None, None, None, :]
    values = prefix[None, None, :, None] * 31 + lane + np.arange(2)[None, :, None, None] * 7 \
        + np.arange(LAYOUT.num_layers)[:, None, None, None] * 13
    return torch.from_numpy((values % 32749).astype(np.int16)).view(torch.bfloat16)


def sequence(rng: random.Random, families=range(FAMILIES)) -> list[int]:
    family = rng.choice(families)
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


def worker(stores: list[KVStore], stop: threading.Event, seed: int, counts: Counter, lock,
           peer: bool = False) -> None:
    """Puts and gets on ``stores`` (one at random each time); with ``peer``, gets ask for
    the peer writer's prompts too."""
    rng = random.Random(seed)
    while not stop.is_set():
        store = rng.choice(stores)
        put = rng.random() < 0.4
        tokens = sequence(rng, PEER_FAMILIES if peer and not put and rng.random() < 0.3
                          else range(FAMILIES))
        try:
            if put:
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


def inject(path: Path, faults: Faults, stop: threading.Event, seed: int, counts: Counter, lock,
           server: RemoteFaults | None = None) -> None:
    """Inject a fault every 0.3 s until ``stop``; an injector that fails fails the soak."""
    try:
        _inject(path, faults, stop, seed, counts, lock, server)
    except Exception as exc:
        with lock:
            counts[f"injector died: {type(exc).__name__}: {exc}"[:120]] += 1
            counts["injector_died"] += 1


def _inject(path: Path, faults: Faults, stop: threading.Event, seed: int, counts: Counter, lock,
            server: RemoteFaults | None) -> None:
    rng = random.Random(seed)
    kinds = ["flip", "flip", "truncate", "eio", "slow", "hang"]
    if server is not None:
        kinds += list(RemoteFaults.KINDS)
    while not stop.wait(0.3):
        kind = rng.choice(kinds)
        if kind.startswith("remote"):
            assert server is not None
            if server.inject(kind, rng):
                with lock:
                    counts[f"fault {kind}"] += 1
            continue
        if kind in ("flip", "truncate"):
            try:
                if not damage_a_file(path, kind, rng):
                    continue  # nothing to corrupt yet: no fault, none counted
            except FileNotFoundError:  # a dead writer's segment reclaimed meanwhile
                continue
        elif kind in ("eio", "slow", "hang"):
            faults.mode = kind
            time.sleep(0.15)
            faults.mode = None
        with lock:
            counts[f"fault {kind}"] += 1


def damage_a_file(path: Path, kind: str, rng: random.Random) -> bool:
    """Flip a byte of, or truncate, a slot file under ``path`` at random; False when there is
    none (with data) yet."""
    # every writer's slot files, wherever the layout puts them (<namespace>/writers/<id>/)
    files = [f for f in path.rglob("slots-*.kvt") if f.is_file() and not f.is_symlink()]
    if not files:
        return False
    target = rng.choice(files)
    size = target.stat().st_size
    if size == 0:
        return False
    with open(target, "r+b") as f:
        if kind == "flip":
            f.seek(rng.randrange(size))
            byte = f.read(1)
            if not byte:  # truncated meanwhile
                return False
            f.seek(f.tell() - 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        else:
            f.truncate(rng.randrange(size))
    return True


PROBE_TOKENS = 9_000_000  # first token of the probes' one-chunk prompts: no worker puts them


def probe_a_flip(path: Path, cfg: dict, phase: int, counts: Counter) -> None:
    """A targeted fault at a phase's end: a chunk put and flushed, a byte in the middle of
    its payload on disk flipped, then a get of it from the store opened anew must serve none
    of it, and count a corruption. (Whether the workers' gets read a byte flipped at random
    is chance: most land in slots never read again.)"""
    tokens = list(range(PROBE_TOKENS + phase * CHUNK, PROBE_TOKENS + (phase + 1) * CHUNK))
    with KVStore(LAYOUT, cfg) as store:
        store.put(tokens, expected_kv(tokens))
        flushed = bool(store.flush(timeout=30))
        key = store.keys(tokens)[0]
    if not flushed or not flip_payload(path, key):
        counts["probe flips not made (not flushed, or its slot not found)"] += 1
        return
    out = torch.zeros(LAYOUT.shape(len(tokens)), dtype=torch.bfloat16)
    with KVStore(LAYOUT, cfg) as store:
        n = store.get(tokens, out)
        corruptions = store.stats().corruptions
    if n and not torch.equal(out[:, :, :n].view(torch.int16),
                             expected_kv(tokens)[:, :, :n].view(torch.int16)):
        counts["wrong_bytes_served"] += 1
    counts["probe flips caught" if n == 0 and corruptions >= 1 else "probe flips missed"] += 1


def flip_payload(path: Path, key: bytes) -> bool:
    """Flip the middle byte of the payload of the slot under ``path`` whose header names
    ``key``; False when no slot does."""
    for slots in (f for f in path.rglob("slots-*.kvt") if f.is_file() and not f.is_symlink()):
        stride = json.loads((slots.parents[2] / "namespace.json").read_text())["stride"]
        with open(slots, "r+b") as f:
            for offset in range(0, slots.stat().st_size - stride + 1, stride):
                f.seek(offset)
                try:
                    header = decode_header(f.read(HEADER_BYTES))
                except HeaderError:
                    continue
                if header.key == key:
                    f.seek(offset + HEADER_BYTES + header.payload_bytes // 2)
                    byte = f.read(1)
                    f.seek(f.tell() - 1)
                    f.write(bytes([byte[0] ^ 0xFF]))
                    return True
    return False


class RemoteFaults:
    """A ``redis-server`` of the soak's own on loopback, and the faults injected into it."""

    KINDS = ("remote flip", "remote truncate", "remote flush", "remote pause", "remote restart")

    def __init__(self, workdir: Path) -> None:
        from tests.helpers.redis_server import RedisServer

        self.server = RedisServer(workdir, "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
        # the server dies with the thread that started it (PR_SET_PDEATHSIG): one thread
        # starts it and restarts it, for the whole run
        self._requests: queue.Queue[queue.Queue[BaseException | None]] = queue.Queue()
        threading.Thread(target=self._keep, daemon=True).start()
        self._restart(first=True)
        self.client = self.server.client()  # its port is the one it started on

    def _keep(self) -> None:
        while True:
            done = self._requests.get()
            try:
                if self.server.started:
                    self.server.stop()
                    time.sleep(0.3)
                self.server.start()
                done.put(None)
            except BaseException as exc:  # handed to the caller
                done.put(exc)

    def _restart(self, first: bool = False) -> None:
        done: queue.Queue[BaseException | None] = queue.Queue()
        self._requests.put(done)
        error = done.get()
        if error is not None:
            raise RuntimeError(f"redis-server did not {'start' if first else 'restart'}") from error

    @property
    def url(self) -> str:
        return self.server.url

    def inject(self, kind: str, rng: random.Random) -> bool:
        """Inject one fault of ``kind``; False when there was nothing to inject it into (or
        the server did not answer the injecting client)."""
        import redis

        try:
            return self._inject(kind, rng)
        except redis.RedisError:
            return False

    def _inject(self, kind: str, rng: random.Random) -> bool:
        if kind == "remote restart":  # every value lost, connections cut
            self._restart()
            return True
        if kind == "remote pause":  # no answer for longer than remote_timeout
            self.client.execute_command("CLIENT", "PAUSE", 1500, "ALL")
            return True
        if kind == "remote flush":
            self.client.flushall()
            return True
        hit = False
        for _ in range(8):  # values at random: most hold chunks of prompts never asked again
            key = self.client.randomkey()
            size = self.client.strlen(key) if key is not None else 0
            if not size:
                continue
            if kind == "remote flip":
                at = rng.randrange(size)
                byte = self.client.getrange(key, at, at)
                if not byte:  # evicted or replaced meanwhile
                    continue
                self.client.setrange(key, at, bytes([byte[0] ^ 0xFF]))
            else:  # "remote truncate"
                self.client.set(key, self.client.getrange(key, 0, rng.randrange(size) - 1))
            hit = True
        return hit

    def idle(self) -> None:
        """Close the injecting client's connections (open descriptors are compared)."""
        self.client.connection_pool.disconnect()

    def stop(self) -> None:
        self.server.stop()
        shutil.rmtree(self.server.workdir, ignore_errors=True)


def start_writer(path: Path, cfg: dict, families: range = range(FAMILIES)) -> subprocess.Popen:
    """Another process putting prompts of ``families`` into the directory until killed."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "import random; from soak import *\n"
            f"s = KVStore(LAYOUT, {cfg!r}); r = random.Random(1)\n"
            "print('ready', flush=True)\n"
            f"while True:\n    t = sequence(r, {families!r}); s.put(t, expected_kv(t))\n")
    # killed with this process, however it ends (started from the main thread, which lives
    # for the whole run)
    return subprocess.Popen([sys.executable, "-c", code], preexec_fn=die_with_parent,
                            stdout=subprocess.PIPE, text=True)


def wait_ready(child: subprocess.Popen, seconds: float = 120.0) -> None:
    """Until ``child`` (``start_writer``'s) has its store open and starts putting, at most
    ``seconds``: its start (importing torch and kvtier) takes seconds on a busy machine,
    which its time to write before it is killed must not include."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], seconds)
    if ready:
        child.stdout.readline()


def kill(child: subprocess.Popen) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.wait()


def kill_a_writer(path: Path, rng: random.Random, cfg: dict) -> None:
    """A second process writing to the directory, killed with SIGKILL mid-way."""
    child = start_writer(path, cfg)
    time.sleep(0.5 + rng.random())
    kill(child)


class FailureKinds(logging.Handler):
    """Counts the failures the stores log, by kind (``FailureLog``: the first of each kind at
    WARNING, the others at DEBUG)."""

    def __init__(self, counts: Counter, lock: threading.Lock) -> None:
        super().__init__(logging.DEBUG)
        self.counts, self.counts_lock = counts, lock  # not ``lock``: the handler's own

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("kvtier %s: %s") and record.args:
            kind = record.args[0] if isinstance(record.args, tuple) else None
            with self.counts_lock:
                self.counts[f"logged {kind}"] += 1


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
    parser.add_argument("--remote", action="store_true",
                        help="a redis-server of its own as the remote tier, and another node")
    parser.add_argument("--shared", action="store_true",
                        help="a shared directory, with a peer writer killed in each phase")
    args = parser.parse_args()
    path = args.dir or Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    server = RemoteFaults(Path(tempfile.mkdtemp(prefix="kvtier-soak-redis-"))) if args.remote else None
    try:
        run(args, path, server)
    finally:
        if server is not None:
            server.stop()


def run(args: argparse.Namespace, path: Path, server: RemoteFaults | None) -> None:
    remote = server.url if server is not None else None
    faults, counts, lock = Faults(), Counter[str](), threading.Lock()
    os.environ.pop("KVTIER_LOG_LEVEL", None)  # each store would set the level counted here
    logger = logging.getLogger("kvtier")
    logger.addHandler(FailureKinds(counts, lock))
    shown = logging.StreamHandler()  # what the stores log at WARNING and above, as before
    shown.setLevel(logging.WARNING)
    logger.addHandler(shown)
    logger.setLevel(logging.DEBUG)
    rng = random.Random(0)
    deadline = time.monotonic() + 60 * args.minutes
    phase_s = min(15.0, 30 * args.minutes)  # two phases at least: both write policies
    samples = []
    phase = 0
    while time.monotonic() < deadline:
        policy = ("write_through", "write_back")[phase % 2]
        store = KVStore(LAYOUT, config(path, policy, remote, args.shared, "soak-main"))
        stores = [store]
        if remote is not None:  # another node: its own host memory, the same remote store
            stores.append(KVStore(LAYOUT, config(None, policy, remote)))
        counts[f"phases {policy}"] += 1
        counts["restarts"] += 1
        counts["recovered_chunks"] += store.stats().recovered_chunks
        peer = start_writer(path, config(path, policy, None, True, "soak-peer"), PEER_FAMILIES) \
            if args.shared else None
        stop = threading.Event()
        threads = [threading.Thread(target=worker, args=(stores, stop, phase * 100 + i, counts, lock,
                                                         args.shared))
                   for i in range(args.threads)]
        threads.append(threading.Thread(target=inject, args=(path, faults, stop, phase, counts, lock,
                                                             server)))
        try:
            for t in threads:
                t.start()
            seconds = min(phase_s, max(1.0, deadline - time.monotonic()))
            if peer is not None:  # killed part-way: its last writes torn, its lease left to run out
                wait_ready(peer)
                alive = seconds * (0.4 + 0.5 * rng.random())
                time.sleep(alive)
                kill(peer)
                counts["fault kill -9 of a peer writer mid-phase"] += 1
                seconds -= alive
            time.sleep(max(0.0, seconds))
        finally:  # on an interrupt too: nothing left running
            stop.set()
            for t in threads:
                if t.is_alive():
                    t.join()
            if peer is not None and peer.poll() is None:
                kill(peer)
        faults.mode = None
        for each in stores:
            stats = each.stats()
            for name in ("corruptions", "io_errors", "no_space", "dropped_writes", "load_timeouts",
                         "remote_reads", "remote_failures", "remote_dropped_writes", "shared_reads",
                         "shared_failures"):
                counts[f"counted {name}"] += getattr(stats, name)
            counts["paths_down at phase end"] += len(stats.paths_down)
            counts["paths back in service"] += stats.paths_back
            each.close()
        if server is not None:
            server.idle()
        probe_a_flip(path, config(path, policy, None, args.shared, "soak-main"), phase, counts)
        samples.append({"fds": len(os.listdir("/proc/self/fd")), "rss_mib": resident_mib()})
        kill_a_writer(path, rng, config(path, policy, remote, args.shared, "soak-main"))
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
    bad = counts["wrong_bytes_served"] or counts["escaped_exceptions"] or counts["injector_died"]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
