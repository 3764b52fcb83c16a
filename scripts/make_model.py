"""Write a small random-weight Llama (config, weights, no tokenizer) for tests and demos.

    python scripts/make_model.py out/models/tiny            # hidden 256, 4 layers
    python scripts/make_model.py out/models/mid --size mid  # hidden 1024, 12 layers

The weights are random (seeded), so outputs are meaningless but deterministic; vLLM runs it
with skip_tokenizer_init=True and prompts given as token ids. Nothing is downloaded.
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
VOCAB = 32000
MAX_POSITIONS = 16384


def make_model(path: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write the model to ``path`` unless it is already there; return ``path``."""
    marker = path / "kvtier-model.json"
    if marker.exists() and json.loads(marker.read_text()) == {"size": size, "seed": seed}:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS,
                         torch_dtype="bfloat16", tie_word_embeddings=False, **SIZES[size])
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps({"size": size, "seed": seed}))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_model(args.path, args.size, args.seed))


if __name__ == "__main__":
    main()
