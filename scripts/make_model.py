"""Write a small random-weight model (config, weights, no tokenizer) for tests and demos.

    python scripts/make_model.py out/models/tiny                     # Llama, hidden 256, 4 layers
    python scripts/make_model.py out/models/mid --size mid           # Llama, hidden 1024, 12 layers
    python scripts/make_model.py out/models/gemma3 --family gemma3   # sliding-window + full layers

Families: ``llama`` (every layer full attention: one KV cache group); ``gemma3`` (Gemma 3's
text model: sliding-window layers (a 256-token window) alternating with full-attention ones,
two KV cache groups under vLLM's hybrid KV cache manager); ``mistral`` (every layer a
256-token sliding window: one group whose blocks out of the window are dropped); ``deepseek``
(DeepSeek-V2's multi-head latent attention, MLA: one latent page per layer and block, no
separate K and V; dense MLP layers only); ``llama4`` (Llama 4's text model: chunked local
attention, a 512-token attention chunk, on three layers of four, the fourth global without
RoPE; dense MLP layers only). The weights are random (seeded),
so outputs are meaningless but deterministic; vLLM runs the model with
skip_tokenizer_init=True and prompts given as token ids. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SIZES = {
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2},
    "mid": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12,
            "num_attention_heads": 16, "num_key_value_heads": 4},
}
FAMILIES = ("llama", "gemma3", "mistral", "deepseek", "llama4")  # see BUILDERS
SLIDING_WINDOW = 256  # tokens (two of vLLM's CPU blocks)
LOCAL_ATTENTION_CHUNK = 512  # tokens (Llama 4's chunked local attention; 8192 in the real one)
VOCAB = 32000
MAX_POSITIONS = 16384


def _decoder(config_class: str, model_class: str, **extra):
    """A builder of a plain decoder of ``SIZES``'s shapes (Llama; Mistral with ``extra``)."""
    def build(size: str):
        import transformers

        config = getattr(transformers, config_class)(
            vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, torch_dtype="bfloat16",
            tie_word_embeddings=False, **SIZES[size], **extra)
        return getattr(transformers, model_class)(config)

    return build


def _gemma3(size: str):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    shape = SIZES[size]
    layers = shape["num_hidden_layers"]
    config = Gemma3TextConfig(
        vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, torch_dtype="bfloat16",
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        **shape)
    return Gemma3ForCausalLM(config)


def _deepseek(size: str):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    shape = SIZES[size]
    heads = shape["num_attention_heads"]
    config = DeepseekV2Config(
        vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, torch_dtype="bfloat16",
        hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=heads, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32, head_dim=64,
        first_k_dense_replace=shape["num_hidden_layers"], n_routed_experts=2,
        tie_word_embeddings=False)
    return DeepseekV2ForCausalLM(config)


def _llama4(size: str):
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    shape = SIZES[size]
    layers = shape["num_hidden_layers"]
    # every fourth layer global (no RoPE, full attention), the others chunked local
    # attention; dense MLPs only (no mixture of experts)
    config = Llama4TextConfig(
        vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, torch_dtype="bfloat16",
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        attention_chunk_size=LOCAL_ATTENTION_CHUNK,
        no_rope_layers=[0 if (i + 1) % 4 == 0 else 1 for i in range(layers)],
        interleave_moe_layer_step=0, moe_layers=[], intermediate_size_mlp=shape["intermediate_size"],
        num_local_experts=1, tie_word_embeddings=False, **shape)
    return Llama4ForCausalLM(config)


BUILDERS = {"llama": _decoder("LlamaConfig", "LlamaForCausalLM"), "gemma3": _gemma3,
            "mistral": _decoder("MistralConfig", "MistralForCausalLM", sliding_window=SLIDING_WINDOW),
            "deepseek": _deepseek, "llama4": _llama4}


def make_model(path: Path, size: str = "tiny", seed: int = 0, family: str = "llama") -> Path:
    """Write the model to ``path`` unless it is already there; return ``path``."""
    marker = path / "kvtier-model.json"
    wanted = {"size": size, "seed": seed} | ({"family": family} if family != "llama" else {})
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return path
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}: choose from {', '.join(FAMILIES)}")
    import torch

    torch.manual_seed(seed)
    model = BUILDERS[family](size).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(wanted))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_model(args.path, args.size, args.seed, args.family))


if __name__ == "__main__":
    main()
