"""A LoRA adapter's files are in its chunks' keys: an adapter replaced under the same name and
path (a new version rolled out, or another version on another engine of the fleet) never
loads the KV the other version computed; the same files give the same keys in every engine,
and requests without an adapter keep the keys they had."""

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

from kvtier.connector.scheduler import adapters
from kvtier.connector.scheduler.adapters import AdapterDigests
from kvtier.connector.scheduler.tails import prompt_tail
from kvtier.keys import block_hash_chunk_key
from tests.helpers.scheduler_side import BLOCK, GEO, request, scheduler


@dataclass
class Prompt:
    """A request with a prompt tail: its tokens and their blocks' hashes."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


def prompt(name: str, length: int) -> Prompt:
    tokens = [i * 31 % 30000 for i in range(length)]
    return Prompt(name, tokens, [bytes([i]) * 32 for i in range(length // BLOCK)])


def adapter(path, weights=b"A" * 5000, config=b'{"r": 8}'):
    path.mkdir(exist_ok=True)
    (path / "adapter_model.safetensors").write_bytes(weights)
    (path / "adapter_config.json").write_bytes(config)
    return path


def with_lora(req, path, name="sql"):
    req.lora_request = SimpleNamespace(lora_name=name, lora_path=str(path), lora_int_id=3)
    return req


def keys(req, side=None):
    """The request's keys in an engine, once its adapter's files are read."""
    side = side or scheduler()
    side.chunk_keys(req, 4)
    side.keys.adapters.settle(10)
    return side.chunk_keys(req, 4)


def digest(req):
    digests = AdapterDigests()
    digests.of(req)
    digests.settle(10)
    return digests.of(req)


def test_an_adapter_replaced_under_its_path_gives_its_chunks_other_keys(tmp_path):
    path = adapter(tmp_path / "sql")
    before = keys(with_lora(request("a", 64), path))
    adapter(path, weights=b"B" * 5000)  # a new version copied over the old files
    after = keys(with_lora(request("a", 64), path))  # a restarted engine
    assert before and all(a != b for a, b in zip(before, after, strict=True))
    adapter(path, weights=b"A" * 5000, config=b'{"r": 16}')
    assert keys(with_lora(request("a", 64), path)) != before


def test_the_same_adapter_files_give_the_same_keys_in_every_engine(tmp_path):
    first, second = adapter(tmp_path / "one"), adapter(tmp_path / "two")
    assert keys(with_lora(request("a", 64), first)) == keys(with_lora(request("a", 64), first))
    # vLLM's hashes already differ by path; with the same path elsewhere, the files decide
    assert digest(with_lora(request("a", 64), first)) == digest(with_lora(request("a", 64), second))


def test_until_its_adapter_is_read_a_request_neither_loads_nor_stores(tmp_path, monkeypatch):
    """The files are read off the step: the step goes on without the request's chunks."""
    gate = threading.Event()
    real = adapters.adapter_digest
    monkeypatch.setattr(adapters, "adapter_digest", lambda path: gate.wait(10) and real(path))
    side, req = scheduler(), with_lora(prompt("a", 70), adapter(tmp_path / "sql"))
    req.block_hashes = request("a", 64).block_hashes
    assert side.chunk_keys(req, 4) == [] and side.tail(req) is None
    assert side.num_new_matched_tokens(req, 0) == (None, False)  # asked again, a while
    assert not side.completes_chunks("a", 64)
    gate.set()
    side.keys.adapters.settle(10)
    assert len(side.chunk_keys(req, 4)) == 2 and side.tail(req) is not None
    side.close()


def test_a_request_without_an_adapter_keeps_its_keys():
    side, req, per = scheduler(), request("a", 64), GEO.hashes_per_chunk
    assert side.chunk_keys(req, 4) == [block_hash_chunk_key(side.keys.namespace, h)
                                       for h in req.block_hashes[per - 1::per]]


def test_a_hub_adapter_is_keyed_by_name_and_path_as_vllm_keys_it():
    assert digest(with_lora(request("a", 64), "org/sql-adapter")) == b"lora:not-local"


def test_an_adapter_under_the_home_directory_is_read_as_vllm_finds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    adapter(tmp_path / "sql")
    assert digest(with_lora(request("a", 64), "~/sql")) == digest(with_lora(request("a", 64),
                                                                         tmp_path / "sql"))


def test_a_prompt_tail_carries_its_adapters_files(tmp_path):
    path = adapter(tmp_path / "sql")
    side = scheduler()
    req = with_lora(prompt("a", 10), path)
    before = prompt_tail(req, GEO, side.keys.namespace, digest(req)).key
    adapter(path, weights=b"C" * 5000)
    assert prompt_tail(req, GEO, side.keys.namespace, digest(req)).key != before


def test_the_last_adapters_are_kept_and_one_used_again_after_is_read_again(tmp_path, monkeypatch):
    reads = []
    monkeypatch.setattr(adapters, "adapter_digest", lambda path: reads.append(path) or b"d")
    monkeypatch.setattr(adapters, "KEPT", 2)
    digests = AdapterDigests()
    for name in ("a", "a", "b", "a", "c", "b"):
        digests.of(with_lora(request("r", 16), tmp_path / name, name=name))
        digests.settle(10)
    assert [p.rsplit("/", 1)[1] for p in reads] == ["a", "b", "c", "b"]  # b dropped for c
    digests.close()


def test_a_requests_keys_never_change_once_known_and_a_slow_read_makes_it_skip_kvtier(
        tmp_path, monkeypatch):
    """Its adapter's part of its keys is kept on the request (another read of the adapter,
    after it was dropped, changes nothing for it); a read that takes longer than
    ADAPTER_WAIT_S leaves the request out of kvtier: no load, no store, no hand-off wait."""
    from kvtier.connector.scheduler import request_keys

    side, path = scheduler(), adapter(tmp_path / "sql")
    req = with_lora(request("a", 64), path)
    first = keys(req, side)
    adapter(path, weights=b"Z" * 5000)
    side.keys.adapters._kept.clear()  # dropped, and read again for the next request
    assert side.chunk_keys(req, 4) == first
    gate = threading.Event()
    monkeypatch.setattr(adapters, "adapter_digest", lambda p: gate.wait(10) and b"late")
    clock = [0.0]
    side.keys._clock = lambda: clock[0]
    slow = with_lora(prompt("s", 70), tmp_path / "other", name="other")
    slow.block_hashes = request("s", 64).block_hashes
    assert side.num_new_matched_tokens(slow, 0) == (None, False)  # asked again
    clock[0] += request_keys.ADAPTER_WAIT_S
    assert side.num_new_matched_tokens(slow, 0) == (0, False)  # a miss, at once
    assert not side.completes_chunks("s", 64) and side.chunk_keys(slow, 4) == []
    gate.set()
    side.close()
