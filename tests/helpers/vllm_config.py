"""A vLLM configuration as kvtier's connector reads it, for tests of the model settings."""

from __future__ import annotations

from types import SimpleNamespace


def engine(**changes):
    """A vLLM config as the connector reads it (Phi-3 style LongRoPE)."""
    hf = {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [4.0]},
          "rope_theta": 10000.0, "max_position_embeddings": 131072,
          "original_max_position_embeddings": 4096}
    model = {"model": "phi-3", "max_model_len": 4096, "quantization": None,
             "dtype": "bfloat16", "hf_overrides": {}, "model_class_overrides": None}
    spec = None
    for name, value in changes.items():
        if name == "draft":
            spec = SimpleNamespace(draft_model_config=SimpleNamespace(model=value))
        elif name in hf:
            hf[name] = value
        else:
            model[name] = value
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf), **model),
                           speculative_config=spec)
