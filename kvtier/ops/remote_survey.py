"""What a remote store holds for kvtier: its chunks by namespace, a sample of them checked
down to their checksums, and the store's memory and evictions (``kvtier inspect URL``).

Only Valkey/Redis can list its keys; a listing is bounded (``limit`` keys, scanned in
batches, never ``KEYS``, the keyspace scanned once: the values checked are picked while
listing), so it is safe on a store in use. The URL is shown redacted (``config.redact``).
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.config.redact import redacted
from kvtier.config.remote_url import backend_of, check_url
from kvtier.ops.value_reads import check_value
from kvtier.remote.deadline import bounded, expired

SCAN_BATCH = 1000
_HEX_PART = re.compile(rb"[0-9a-f]{32}")  # a namespace digest, a chunk key: as kvtier names them


@dataclass
class NamespaceHoldings:
    """One namespace's chunks in the store: count, bytes, and the sample checked."""

    digest: str
    chunks: int = 0
    value_bytes: int = 0
    checked: int = 0
    bad: int = 0  # sampled values that failed their checks
    chunk_sizes: str = ""  # the chunk size of the values sampled, e.g. "2.0MiB"


@dataclass
class RemoteSurvey:
    url: str  # redacted: no credentials, no query values
    backend: str
    prefix: str
    keys_seen: int
    complete: bool  # every key was listed (False: stopped at the limit, or cut short)
    namespaces: list[NamespaceHoldings] = field(default_factory=list)
    server: dict[str, Any] = field(default_factory=dict)
    foreign_keys: int = 0  # keys under the prefix not of kvtier's form, or not strings
    record_logs: int = 0  # logs of token records (``<prefix>log:<namespace>``, streams)
    cut_short: bool = False  # the timeout passed: what was seen until then

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class SurveyError(Exception):
    """The store cannot be surveyed (unreachable, or a backend that lists nothing)."""


def survey(url: str, prefix: str = "kvtier:", limit: int = 1_000_000, sample: int = 4,
           timeout: float | None = None) -> RemoteSurvey:
    """List (up to ``limit``) kvtier's keys under ``prefix``, count them per namespace and
    check ``sample`` values of each; ``SurveyError`` naming what went wrong. Everything it
    does ends within ``timeout`` seconds in all (``remote.deadline``, however slowly the
    store answers): past it, what was seen so far, ``cut_short``."""
    check_url(url)
    backend = backend_of(url)
    if backend != "redis":
        raise SurveyError(f"{backend} stores cannot list their keys: inspect a Mooncake store "
                          "with its master's metrics (mooncake_master -metrics_port)")
    from kvtier.config.redis_url import PASSWORD_ENV, USER_ENV
    from kvtier.remote.redis_client import connect, explained

    client, late = None, False
    try:  # a cluster's client connects as it is made: its failure is the survey's too
        with bounded(timeout):
            try:
                client = connect(url, 10.0, {k: os.environ[k] for k in (USER_ENV, PASSWORD_ENV)
                                             if k in os.environ})
                return _survey_redis(client, redacted(url), prefix, limit, sample)
            except Exception:
                late = expired()
                raise
    except SurveyError:
        raise
    except Exception as exc:  # the client's errors for every transport fault
        why = f"no answer within --timeout {timeout:g} s" if late else explained(exc)
        raise SurveyError(f"{redacted(url)}: {why}") from exc
    finally:
        if client is not None:
            client.close()


def _survey_redis(client: Any, url: str, prefix: str, limit: int, sample: int) -> RemoteSurvey:
    """The survey, or what it saw before the deadline passed (``cut_short``)."""
    found: dict[str, NamespaceHoldings] = {}
    result = RemoteSurvey(url, "redis", prefix, 0, True)
    _answers(client)  # a store that does not answer at all fails the survey: it is not empty
    try:
        _walk(client, prefix, limit, sample, found, result)
    except Exception:
        if not expired():
            raise
        result.cut_short = True
    result.namespaces = sorted(found.values(), key=lambda h: -h.value_bytes)
    return result


def _answers(client: Any) -> None:
    """Raise unless the store answers a ``PING``; a refusal is an answer (an ACL user of
    docs/remote.md's may not run it)."""
    from redis.exceptions import ResponseError

    with contextlib.suppress(ResponseError):
        client.ping()


def _walk(client: Any, prefix: str, limit: int, sample: int, found: dict[str, NamespaceHoldings],
          result: RemoteSurvey) -> None:
    picked: dict[str, list[bytes]] = {}  # per namespace, the first ``sample`` names listed
    batch: list[bytes] = []
    result.complete = False  # until every key was listed
    for name in client.scan_iter(match=prefix.encode() + b"*", count=SCAN_BATCH):
        if result.keys_seen >= limit:
            break
        result.keys_seen += 1
        batch.append(name)
        if len(batch) == SCAN_BATCH:
            _count(client, batch, prefix, found, result, picked, sample)
            batch = []
    else:
        result.complete = True
    _count(client, batch, prefix, found, result, picked, sample)
    for digest, holdings in found.items():
        _check_sample(client, prefix, holdings, picked.get(digest, []))
    info = client.info("memory") | client.info("stats")
    result.server = {k: info.get(k) for k in ("used_memory", "maxmemory", "maxmemory_policy",
                                              "evicted_keys")}


def _count(client: Any, names: list[bytes], prefix: str, found: dict[str, NamespaceHoldings],
           result: RemoteSurvey, picked: dict[str, list[bytes]], sample: int) -> None:
    """Count ``names`` (one listed batch) per namespace, and pick the first ``sample`` of
    each namespace for checking. A key not of kvtier's form ``<prefix><namespace>:<key>``
    (32 hex digits each), or not a string (its length an error reply), is foreign, but for
    a namespace's log of token records, ``<prefix>log:<namespace>``."""
    if not names:
        return
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.strlen(name)
    for name, length in zip(names, pipe.execute(raise_on_error=False), strict=True):
        parts = name[len(prefix):].split(b":")
        if len(parts) == 2 and parts[0] == b"log" and _HEX_PART.fullmatch(parts[1]):
            result.record_logs += 1  # a stream: its STRLEN is an error reply
            continue
        if (isinstance(length, Exception) or len(parts) != 2
                or not all(_HEX_PART.fullmatch(part) for part in parts)):
            result.foreign_keys += 1
            continue
        digest = parts[0].decode()
        holdings = found.setdefault(digest, NamespaceHoldings(digest))
        holdings.chunks += 1
        holdings.value_bytes += int(length or 0)
        chosen = picked.setdefault(digest, [])
        if len(chosen) < sample:
            chosen.append(name)


def _check_sample(client: Any, prefix: str, holdings: NamespaceHoldings, names: list[bytes]) -> None:
    """Check the values of ``names`` (the namespace's sample): header, key, lengths, checksum,
    each read in bounded pieces, never whole (``value_reads.check_value``)."""
    from redis.exceptions import ResponseError

    sizes = set()
    for name in names:
        try:
            found = check_value(client, name, prefix)
        except ResponseError:  # no longer a string (WRONGTYPE): not a chunk of kvtier's
            continue
        if found is None:  # evicted meanwhile
            continue
        holdings.checked += 1
        if found.problem:
            holdings.bad += 1
        else:
            sizes.add(found.payload_bytes)
    if sizes:
        from kvtier.units import format_size

        holdings.chunk_sizes = ", ".join(format_size(s) for s in sorted(sizes))
