"""The shape of a model's KV cache, as the standalone store sees it.

A sequence's KV is one tensor ``(num_layers, 2, num_tokens, kv_heads * head_size)``: for each
layer, K then V, token by token. A chunk is the same with ``num_tokens = chunk_tokens``; the
store keeps chunks contiguous in that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.errors import LayoutError
from kvtier.keys import Namespace
from kvtier.units import positive_count

LAYOUT_NAME = "layers,kv,tokens,hidden"
LAYOUT_VERSION = 1

DTYPE_BYTES = {
    "float32": 4, "bfloat16": 2, "float16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1,
}


@dataclass(frozen=True)
class KVLayout:
    """KV shape of one model shard: layers, KV heads, head size and element type."""

    num_layers: int
    kv_heads: int
    head_size: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_size"):
            value = getattr(self, name)
            whole = positive_count(value)
            if not whole:
                raise LayoutError(f"KVLayout: {name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, whole)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise LayoutError(f"KVLayout: dtype {self.dtype!r} not supported; use one of the "
                              f"names {sorted(DTYPE_BYTES)}")

    @property
    def hidden(self) -> int:
        return self.kv_heads * self.head_size

    @property
    def token_bytes(self) -> int:
        """Bytes of KV per token, all layers, K and V."""
        return self.num_layers * 2 * self.hidden * DTYPE_BYTES[self.dtype]

    def shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (self.num_layers, 2, num_tokens, self.hidden)

    def check_tensor(self, kv: Any, min_tokens: int, what: str) -> None:
        """``LayoutError``, naming what was passed, unless ``kv`` is a dense torch tensor
        with memory, of this layout's dtype and shape, with at least ``min_tokens`` tokens."""
        import torch  # here, not at the top: ``import kvtier`` stays light

        want = self.shape(min_tokens)
        if not isinstance(kv, torch.Tensor):
            kind = f"{type(kv).__module__}.{type(kv).__qualname__}".removeprefix("builtins.")
            hint = " (torch.from_numpy(array) shares its memory)" if kind == "numpy.ndarray" else ""
            raise LayoutError(
                f"{what} must be a torch.Tensor of {self.dtype}, shape (layers={want[0]}, 2, "
                f"tokens>={min_tokens}, hidden={want[3]}), got a {kind}{hint}"
            )
        if kv.layout != torch.strided or kv.is_meta:
            raise LayoutError(f"{what} must be a dense tensor with memory, got a {kv.layout} "
                              f"tensor on {kv.device}")
        dtype = str(kv.dtype).removeprefix("torch.")
        if (kv.dim() != 4 or kv.shape[:2] != want[:2] or kv.shape[3] != want[3]
                or kv.shape[2] < min_tokens or dtype != self.dtype):
            raise LayoutError(
                f"{what} must be a {self.dtype} tensor of shape (layers={want[0]}, 2, "
                f"tokens>={min_tokens}, hidden={want[3]}), got {kv.dtype} {tuple(kv.shape)}"
            )

    def namespace(self, model: str, chunk_tokens: int, *, block_tokens: int | None = None,
                  model_revision: str = "") -> Namespace:
        """The namespace of this layout's chunks for ``model``."""
        return Namespace(
            model=model,
            model_revision=model_revision,
            kv_dtype=self.dtype,
            layout=f"{LAYOUT_NAME}:{self.num_layers}x2x{self.hidden}",
            layout_version=LAYOUT_VERSION,
            block_tokens=block_tokens or chunk_tokens,
            chunk_tokens=chunk_tokens,
        )
