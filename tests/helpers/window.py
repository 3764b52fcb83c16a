"""A hybrid model's worker side (two KV cache groups: full attention, then a 32-token sliding
window): its geometry, and a byte-for-byte comparison of pages."""

import torch

from kvtier.connector.common.geometry import KVGeometry

BLOCK, CHUNK = 16, 32
LAYERS, BLOCKS, HIDDEN = 4, 16, 64
WORKER_GEO = KVGeometry(LAYERS, 2 * BLOCK * HIDDEN * 2, BLOCK, BLOCK, CHUNK, "bfloat16", "t",
                        group_layers=(2, 2), group_kinds=("full", "sliding32"))


def same(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))
