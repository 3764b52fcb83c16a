"""Talking to Mooncake Store's client (``mooncake.store``): its error codes, what they mean,
reaching its master, and the environment its setup reads."""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

from kvtier.config.mooncake_url import MooncakeOptions
from kvtier.io.result import IOResult, IOStatus
from kvtier.remote.resolve import RESOLVER

# Mooncake's error codes (mooncake-store's ErrorCode), as its client returns them
NO_SPACE, INVALID_PARAMS, NOT_FOUND, TRANSFER_FAIL, RPC_FAIL, RPC_TIMEOUT = \
    -200, -600, -704, -800, -900, -901
CODE_NAMES = {-1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
              NO_SPACE: "NO_AVAILABLE_HANDLE", -400: "INVALID_KEY", INVALID_PARAMS: "INVALID_PARAMS",
              -703: "REPLICA_IS_NOT_READY", NOT_FOUND: "OBJECT_NOT_FOUND",
              -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
              -710: "REPLICA_NOT_FOUND", -712: "REPLICA_IS_GONE", TRANSFER_FAIL: "TRANSFER_FAIL",
              RPC_FAIL: "RPC_FAIL", RPC_TIMEOUT: "RPC_TIMEOUT",
              -1010: "UNAVAILABLE_IN_CURRENT_STATUS"}
GONE = frozenset((-703, NOT_FOUND, -707, -710, -712))  # not held (or not yet, or evicted meanwhile)
STORED = frozenset((0, -705))  # a put of a key the store holds already leaves that value

SETUP_LOCK = threading.Lock()  # clients set up one at a time: they read the environment


def code_name(code: int) -> str:
    return f"{CODE_NAMES.get(code, 'error')} ({code})"


def put_result(code: int, raw_bytes: int) -> IOResult:
    """What a put's answer ``code`` means for one chunk."""
    if code in STORED:
        return IOResult(IOStatus.OK, raw_bytes)
    status = IOStatus.NO_SPACE if code == NO_SPACE else IOStatus.IO_ERROR
    return IOResult(status, 0, f"put: {code_name(code)}")


def unreachable(what: str, code: int) -> OSError | None:
    """The failure ``code`` means when the master did not answer; None for other codes."""
    if code == RPC_TIMEOUT:
        return TimeoutError(f"{what}: the master did not answer in time ({code_name(code)})")
    if code == RPC_FAIL:
        return ConnectionError(f"{what}: the master is unreachable ({code_name(code)})")
    return None


def master_addresses(master: str, timeout_s: float) -> list[tuple[int, tuple]]:
    """The family and socket address of each address of ``master`` (``host:port``), its
    name looked up within ``timeout_s`` (``RESOLVER``: a resolver that does not answer
    holds no caller longer), IPv4 first unless the host is bracketed; ``OSError`` when it
    has none."""
    host, _, port = master.rpartition(":")
    found = [(family, address) for family, _, _, _, address in RESOLVER.addresses(
        host.strip("[]"), int(port), socket.AF_UNSPEC, timeout_s)]
    first = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    return sorted(found, key=lambda found: found[0] != first)


def reachable(master: str, timeout_s: float) -> None:
    """``OSError`` unless ``master`` (``host:port``) takes a TCP connection on one of its
    addresses within ``timeout_s``, its name looked up within it too."""
    deadline, failure = time.monotonic() + timeout_s, OSError("its name has no address")
    try:
        for family, address in master_addresses(master, timeout_s):
            try:
                with socket.socket(family, socket.SOCK_STREAM) as sock:
                    sock.settimeout(max(0.001, deadline - time.monotonic()))
                    sock.connect(address)
                return
            except OSError as exc:  # the next address, while time is left
                failure = exc
                if time.monotonic() >= deadline:
                    break
        raise failure
    except TimeoutError:
        raise TimeoutError(f"master {master} did not take a connection within {timeout_s:g} s") from None
    except OSError as exc:
        raise ConnectionError(f"master {master} is unreachable: {exc.strerror or exc}") from None


@contextlib.contextmanager
def unset_only(environ: MutableMapping[str, str], values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``environ`` for a while, each where the operator set nothing."""
    added = [name for name in values if name not in environ]
    for name in added:
        environ[name] = values[name]
    try:
        yield
    finally:
        for name in added:
            environ.pop(name, None)


def local_address(master: str, timeout_s: float) -> str:
    """The local address that routes to ``master`` (``host:port``, its name looked up
    within ``timeout_s``): peers reach us there."""
    with contextlib.suppress(OSError):
        family, address = master_addresses(master, timeout_s)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(address)  # a datagram socket: nothing is sent
            return str(s.getsockname()[0])
    return socket.gethostname()


def client_module() -> Any:
    try:
        import mooncake.store
    except ImportError:
        raise ImportError("the Mooncake remote tier needs the Mooncake Store client: pip "
                          "install 'kvtier[mooncake]' (or mooncake-transfer-engine-non-cuda)") from None
    return mooncake.store


def set_up(module: Any, opts: MooncakeOptions, timeout_s: float, environ: MutableMapping[str, str]) -> Any:
    """A client of ``module`` (``mooncake.store``) set up as ``opts`` say, its timeouts from
    ``timeout_s`` where the operator set none (it holds the GIL meanwhile: a master
    reachable but hung costs the process up to its RPC timeout, ``timeout_s``);
    ``ConnectionError`` when the setup fails."""
    host = opts.host or local_address(opts.master, timeout_s)
    rpc_ms = str(max(1, round(timeout_s * 1000)))
    environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(max(1, math.ceil(timeout_s))))
    with SETUP_LOCK, unset_only(environ, {"MC_RPC_TIMEOUT_MS": rpc_ms, "MC_STORE_CLIENT_SETUP_RETRIES": "1"}):
        client = module.MooncakeDistributedStore()
        code = client.setup(host, opts.metadata, opts.segment, 0, opts.protocol, opts.device, opts.master)
    if code != 0:
        raise ConnectionError(f"setting up a client of master {opts.master} failed ({code}): "
                              "its log and this process's stderr say why")
    return client
