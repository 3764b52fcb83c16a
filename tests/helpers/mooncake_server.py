"""A real Mooncake Store for the remote tier's tests: a ``mooncake_master`` and a holder (a
process that lends the pool its memory, so that bytes cross TCP loopback between processes),
on free loopback ports, started, stopped and restarted on the same ports by the tests.

Mooncake's listeners bind every interface whatever they are told, so all of it runs only
inside a private network namespace that holds nothing but loopback (``unshare -n``, as
root): ``run_in_namespace`` starts a command there, ``inside_namespace`` tells a test it is.
Every wait is bounded.

    python tests/helpers/mooncake_server.py hold 127.0.0.1:50051 64MiB   # the holder
"""

from __future__ import annotations

import importlib.util
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a script (the holder): the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers.subprocesses import die_with_parent

NETNS_ENV = "MOONCAKE_PRIVATE_NETNS"  # set by run_in_namespace for what it starts
ROOT = Path(__file__).resolve().parents[2]


def master_binary() -> Path | None:
    """The ``mooncake_master`` the installed client ships (or one on PATH)."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / "mooncake_master").is_file():
            return Path(folder) / "mooncake_master"
    found = shutil.which("mooncake_master")
    return Path(found) if found else None


def skip_reason() -> str | None:
    """Why the Mooncake tests cannot run here (and how to make them), or None."""
    if os.geteuid() != 0:
        return "the Mooncake tests need root for a private network namespace (unshare -n): run as root"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y util-linux iproute2)"
    if importlib.util.find_spec("mooncake") is None or master_binary() is None:
        return "Mooncake Store is not installed: pip install 'kvtier[mooncake]'"
    return None


def inside_namespace() -> bool:
    """Whether this process runs where run_in_namespace put it: no interface but ``lo``."""
    return os.environ.get(NETNS_ENV) == "1" and [n for _, n in socket.if_nameindex()] == ["lo"]


def run_in_namespace(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``argv`` run in a new network namespace with loopback up, from the repository root."""
    return subprocess.run(["unshare", "-n", "--", "bash", "-c", 'ip link set lo up && exec "$@"',
                           "bash", *argv], cwd=ROOT, env={**os.environ, NETNS_ENV: "1"},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(port: int, process: subprocess.Popen, deadline: float, what: str) -> None:
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.02)


class MooncakeServer:
    """A master and a holder lending ``segment`` bytes; ``master_args`` go to the master."""

    def __init__(self, workdir: Path, segment: int = 256 * 2**20, *master_args: str) -> None:
        assert inside_namespace(), "Mooncake binds every interface: start it only in a namespace"
        self.workdir, self.segment, self.master_args = workdir, segment, master_args
        self.port, self.metrics_port = free_port(), free_port()
        self.master: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None
        self._clients: list[Any] = []
        self._holders: list[subprocess.Popen] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"mooncake://{self.address}"

    def start(self) -> MooncakeServer:
        """A fresh (empty) master on this server's port, then a fresh holder."""
        self.stop()
        binary = master_binary()
        assert binary is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "master.log", "ab") as out:
            self.master = subprocess.Popen(
                [str(binary), "-rpc_address=127.0.0.1", f"-rpc_port={self.port}",
                 "-metrics_host=127.0.0.1", f"-metrics_port={self.metrics_port}",
                 f"-log_dir={self.workdir}", *self.master_args],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent)
        try:
            _wait_for_port(self.port, self.master, time.monotonic() + 20, "mooncake_master")
            self._start_holder()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_holder(self) -> None:
        self.holder = self.another_holder()

    def another_holder(self) -> subprocess.Popen:
        """One more holder lending ``segment`` bytes (stopped with the server)."""
        with open(self.workdir / "holder.log", "ab") as err:
            holder = subprocess.Popen(
                [sys.executable, __file__, "hold", self.address, str(self.segment)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                preexec_fn=die_with_parent)
        self._holders.append(holder)
        assert holder.stdout is not None
        ready, _, _ = select.select([holder.stdout], [], [], 20)
        line = holder.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            raise RuntimeError(f"the holder did not start ({line!r}): {self.log('holder')[-2000:]}")
        return holder

    def log(self, which: str = "master") -> str:
        path = self.workdir / f"{which}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill_master(self) -> None:
        _kill(self.master)

    def pause(self, process: subprocess.Popen | None) -> None:
        """Stop ``process`` (SIGSTOP), returning once every thread of it has stopped."""
        assert process is not None
        os.kill(process.pid, signal.SIGSTOP)
        tasks, deadline = Path(f"/proc/{process.pid}/task"), time.monotonic() + 5
        while not all(_state(task) in "Tt" for task in tasks.iterdir()):
            assert time.monotonic() < deadline, "the process did not stop"
            time.sleep(0.005)

    def resume(self, process: subprocess.Popen | None) -> None:
        assert process is not None
        os.kill(process.pid, signal.SIGCONT)

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()
        for holder in self._holders:
            _kill(holder)
        self._holders.clear()
        _kill(self.master)

    def client(self) -> Any:
        """A plain client of this store (segment 0), to read and damage values directly."""
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        code = client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 * 2**20, "tcp", "", self.address)
        assert code == 0, f"a plain client could not set up ({code})"
        self._clients.append(client)
        return client


def _state(task: Path) -> str:
    """A thread's state letter (``T``: stopped), from /proc; ``T`` once it is gone."""
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "T"


def _kill(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        os.kill(process.pid, signal.SIGCONT)  # a paused one too
        process.kill()
        process.wait(timeout=20)


def hold(master: str, segment: int) -> None:
    """Lend ``segment`` bytes to ``master``'s pool until stdin closes (the test ended)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 * 2**20, "tcp", "", master)
    if code != 0:
        sys.exit(f"holder: setup failed ({code})")
    print("ready", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "hold":
        sys.exit(__doc__)
    if not inside_namespace():
        sys.exit("the holder runs only inside a private network namespace (see run_in_namespace)")
    hold(sys.argv[2], int(sys.argv[3]))
