"""A thread kvtier starts on demand, inside one of vLLM's calls, may be refused (a pids
limit, ``RLIMIT_NPROC``, memory: ``RuntimeError: can't start new thread``). The call then
goes on without it and nothing stays stuck: what the thread was for is tried again at a later
call. (A pool's threads start with it, at the engine's start: tests/test_guarded_submit.py.)"""

import threading
from collections import Counter
from types import SimpleNamespace

import pytest

from kvtier.connector.scheduler.adapters import AdapterDigests
from kvtier.connector.scheduler.verify_halt import VerifyHalt
from kvtier.remote.slot_map import SlotMapRefresh
from kvtier.segment.halt_file import HaltFile
from kvtier.shared.kept_files import KeptFiles
from tests.helpers.hostile import make_cache, namespace_of
from tests.helpers.shared import wait_for


@pytest.fixture
def refused(monkeypatch):
    """While set, no thread of kvtier's can start."""
    refusing = threading.Event()
    real = threading.Thread.start

    def start(thread):
        if refusing.is_set() and thread.name.startswith("kvtier-"):
            raise RuntimeError("can't start new thread")
        return real(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    refusing.set()
    return refusing


def test_a_sweep_of_kept_files_refused_a_thread_is_tried_again(refused):
    kept = KeptFiles()
    kept._swept = 0.0  # white-box: a sweep is due
    kept.sweep_soon()
    assert kept._sweeping.acquire(blocking=False)  # not held by a sweep that never started
    kept._sweeping.release()


def test_an_adapter_whose_reader_was_refused_is_read_once_one_starts(refused, tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"A" * 100)
    request = SimpleNamespace(lora_request=SimpleNamespace(lora_name="sql", lora_path=str(tmp_path)))
    digests = AdapterDigests()
    assert digests.of(request) is None and digests.of(request) is None
    refused.clear()
    assert digests.of(request) is None  # a reader starts now
    digests.settle(10)
    assert digests.of(request)
    digests.close()


def test_a_slot_map_refresh_refused_a_thread_stays_due(refused):
    asked = []
    refresh = SlotMapRefresh(1.0, lambda client: asked.append(client) or False)
    client = SimpleNamespace(nodes_manager=SimpleNamespace(initialize=lambda: None))  # (< 7.4)
    refresh.mark()
    refresh.start(client)
    assert refresh.stale and asked == []
    refused.clear()
    refresh.start(client)
    wait_for(lambda: asked == [client])
    refresh.close(1.0)


def test_a_halt_whose_file_could_not_be_written_on_a_thread_still_halts(refused, tmp_path):
    refused.clear()  # the cache's store and the halt's watcher start with the engine
    ns = namespace_of(make_cache(tmp_path / "cache"))
    halt = VerifyHalt(1, Counter(), HaltFile(ns.parent, ns.name))
    refused.set()
    halt.mismatch()  # the halt file's writer refused: no file, the halt holds all the same
    assert halt.halted and not (ns / "halt.json").exists()
