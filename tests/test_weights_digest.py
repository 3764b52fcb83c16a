"""A local model's weights replaced in place name another namespace: an engine never loads
KV that other weights computed under the same path; copies of the same bytes share theirs."""

import os
import threading

import numpy as np
import pytest

from kvtier.connector.common import weights_digest as wd
from kvtier.connector.common.model_settings import model_settings, settings_digest
from tests.helpers.vllm_config import engine

SIZE = 3 * 2**20 + 123  # past SAMPLES * SAMPLE_BYTES: sampled, not read whole


def model_dir(path, seed=0, shards=2, size=SIZE):
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    rng = np.random.default_rng(seed)
    for shard in range(shards):
        (path / f"model-{shard:05d}.safetensors").write_bytes(rng.bytes(size))
    return path


def test_weights_replaced_in_place_change_the_digest_and_the_namespace(tmp_path):
    model = model_dir(tmp_path / "m")
    before = wd.weights_digest(str(model))
    settings = settings_digest(engine(model=str(model)))
    (model / "model-00001.safetensors").write_bytes(np.random.default_rng(9).bytes(SIZE))
    assert wd.weights_digest(str(model)) != before  # a fine-tune: same names, same sizes
    assert settings_digest(engine(model=str(model))) != settings


def test_a_copy_of_the_same_bytes_elsewhere_and_later_has_the_same_digest(tmp_path):
    first, second = model_dir(tmp_path / "a"), model_dir(tmp_path / "b")
    os.utime(second / "model-00000.safetensors", (1, 1))
    assert wd.weights_digest(str(first)) == wd.weights_digest(str(second)) is not None


def test_each_sample_changed_alone_changes_the_digest(tmp_path):
    model = model_dir(tmp_path / "m", shards=1)
    path, before = model / "model-00000.safetensors", wd.weights_digest(str(model))
    offsets = wd.sample_offsets(SIZE)
    assert offsets[0] == 0 and offsets[-1] == SIZE - wd.SAMPLE_BYTES and len(offsets) == wd.SAMPLES
    for offset in (offsets[0], offsets[len(offsets) // 2], offsets[-1]):
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))
        assert wd.weights_digest(str(model)) != before
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))
    assert wd.weights_digest(str(model)) == before


def test_a_small_file_is_read_whole(tmp_path):
    model = model_dir(tmp_path / "m", shards=1, size=10_000)
    path, before = model / "model-00000.safetensors", wd.weights_digest(str(model))
    data = bytearray(path.read_bytes())
    data[7_777] ^= 1
    path.write_bytes(bytes(data))
    assert wd.weights_digest(str(model)) != before


def test_a_hub_snapshots_links_are_followed(tmp_path):
    blobs, snapshot = model_dir(tmp_path / "blobs"), tmp_path / "snapshot"
    snapshot.mkdir()
    for name in ("model-00000.safetensors", "model-00001.safetensors"):
        (snapshot / name).symlink_to(blobs / name)
    assert wd.weights_digest(str(snapshot)) == wd.weights_digest(str(blobs))


def test_no_weights_or_a_hub_name_give_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert wd.weights_digest(str(tmp_path)) is None
    assert wd.weights_digest(str(tmp_path / "missing")) is None
    assert "weights" not in model_settings(engine(model="org/hub-model"))


def test_a_draft_models_weights_replaced_in_place_change_the_digest(tmp_path):
    draft = model_dir(tmp_path / "draft", shards=1)
    before = settings_digest(engine(draft=str(draft)))
    (draft / "model-00000.safetensors").write_bytes(b"another draft")
    assert settings_digest(engine(draft=str(draft))) != before


def test_a_fifo_named_as_weights_is_not_waited_on(tmp_path):
    model = model_dir(tmp_path / "m", shards=1)
    os.mkfifo(model / "model-00001.safetensors")
    answer = []
    reader = threading.Thread(target=lambda: answer.append(wd.weights_digest(str(model))),
                              daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert answer and answer[0] is not None


def test_files_past_the_bound_are_named_but_not_read(tmp_path, monkeypatch):
    model = model_dir(tmp_path / "m", shards=3, size=5000)
    monkeypatch.setattr(wd, "MAX_FILES", 2)
    before = wd.weights_digest(str(model))
    (model / "model-00002.safetensors").write_bytes(b"x" * 5000)
    assert wd.weights_digest(str(model)) == before
    (model / "model-00003.safetensors").write_bytes(b"")
    assert wd.weights_digest(str(model)) != before


@pytest.mark.parametrize("suffix", wd.SUFFIXES)
def test_every_weight_format_counts(tmp_path, suffix):
    tmp_path.joinpath(f"weights{suffix}").write_bytes(b"a" * 100)
    before = wd.weights_digest(str(tmp_path))
    tmp_path.joinpath(f"weights{suffix}").write_bytes(b"b" * 100)
    assert before is not None and wd.weights_digest(str(tmp_path)) != before


def test_a_model_given_as_one_file_is_fingerprinted(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"G" * 9000)
    before = settings_digest(engine(model=str(model)))
    assert "weights" in model_settings(engine(model=str(model)))
    model.write_bytes(b"H" * 9000)
    assert settings_digest(engine(model=str(model))) != before
