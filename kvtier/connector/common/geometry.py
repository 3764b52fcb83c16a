"""What kvtier needs to know about vLLM's paged KV cache, on both sides of the connector.

The scheduler side derives it from vLLM's ``KVCacheConfig``; the worker side checks it against the KV
tensors it is handed. A chunk in a host slot or on disk is the chunk's pages, layer by layer:
``(num_layers, blocks_per_chunk, page_bytes)``, whole pages copied as bytes (so the bytes are whatever
vLLM keeps in a page, in whatever layout it uses: see ``page_view`` for layouts whose pages are one run
per head).

A hybrid model (vLLM's hybrid KV cache manager on) has several KV cache groups: full attention, sliding
window, chunked local attention, each with its own block table. A chunk then covers every group: the
layers are in group order (the first group's layers, then the next group's), and a chunk's block ids are
each group's blocks for its tokens, group after group. A group keeps no block for tokens that fell out
of its window (vLLM's null block): those pages are neither stored (the chunk is not offered) nor loaded
(nothing to fill). On disk each group's part of a chunk is checked on its own (``part_bytes``), so a
load reads only the parts of the groups it fills, and a chunk no group needs is not read at all.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from kvtier.config.settings import KVTierConfig
from kvtier.connector.common.messages import NULL_BLOCK
from kvtier.connector.common.page_values import kv_run, value_dtype
from kvtier.connector.common.reference_mla import is_reference_cpu_mla
from kvtier.errors import ConfigError
from kvtier.keys import Namespace

log = logging.getLogger("kvtier")

LAYOUT_NAME = "vllm-pages"
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one rank's paged KV cache and of kvtier's chunks over it."""

    num_layers: int
    page_bytes: int  # one block of one layer (K and V)
    block_tokens: int  # tokens per GPU block
    hash_block_tokens: int  # tokens per vLLM block hash
    chunk_tokens: int
    kv_dtype: str
    page_shape: str  # per-block tensor shape, as vLLM lays it out
    group_layers: tuple[int, ...] = ()  # layers per KV cache group (hybrid); () = one group
    layer_names: tuple[str, ...] = ()  # vLLM's layer names in chunk order; () = as registered
    group_kinds: tuple[str, ...] = ()  # "full", "mla", "sliding256", "local512" per group
    page_order: str = "HNC"  # a page's dims in memory: heads, tokens, content (page_view)
    retained_tokens: int = 0  # kept past a sliding window (vLLM's extra_retained_tokens)
    kv_run: tuple[int, int] = (0, 0)  # values of K, then of V, in turn in a page (page_values); 0s: one part
    value_dtype: str = ""  # what a page's values decode as (page_values); "": as kv_dtype
    reference_cpu_mla: bool = False  # vLLM's reference MLA backend on the CPU (reference_mla)

    @property
    def groups(self) -> tuple[int, ...]:
        """Layers per KV cache group, in chunk order."""
        return self.group_layers or (self.num_layers,)

    @property
    def loads_whole(self) -> bool:
        """Whether a failed load must be recomputed whole, as a request, not from its first failed block: with
        several groups vLLM cannot map a block id back to a request, and with a sliding window (or chunked
        local attention) recomputing from a failed block would need the window before it, which the load
        skipped (the null block). Such loads are all asynchronous, the only kind vLLM takes back as a failed
        request."""
        return len(self.groups) > 1 or any(k.startswith(("sliding", "local"))
                                           for k in self.group_kinds)

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_tokens

    @property
    def hashes_per_chunk(self) -> int:
        return self.chunk_tokens // self.hash_block_tokens

    @property
    def chunk_bytes(self) -> int:
        return self.num_layers * self.blocks_per_chunk * self.page_bytes

    @property
    def part_bytes(self) -> tuple[int, ...]:
        """Bytes of each KV cache group's part of a chunk, in chunk order (its pages, layer
        by layer), as the disk tier keeps them apart; () with one group."""
        if len(self.groups) < 2:
            return ()
        return tuple(n * self.blocks_per_chunk * self.page_bytes for n in self.groups)

    def unstored_replies(self) -> str | None:
        """Why some chunks completed while decoding cannot be stored (a group drops a
        chunk's first pages before the step that completes it: vLLM frees a block at the
        step after it left the window), or None."""
        for kind in self.group_kinds:
            if kind.startswith("sliding") and self.chunk_tokens > int(kind.removeprefix("sliding")):
                return (f"chunk_tokens ({self.chunk_tokens}) is longer than a sliding window "
                        f"({kind.removeprefix('sliding')} tokens)")
            if kind.startswith("local") and int(kind.removeprefix("local")) % self.chunk_tokens:
                return (f"chunk_tokens ({self.chunk_tokens}) does not divide the local "
                        f"attention chunk ({kind.removeprefix('local')} tokens)")
        return None

    def kept_from(self, end: int) -> list[int]:
        """For a request computed up to token ``end``, the first token each group still keeps
        a block for (vLLM's skipped tokens: a sliding window of W keeps the last W - 1, and
        ``retained_tokens`` more, a chunked local attention group the current attention
        chunk; the others keep all)."""
        kept = []
        for kind in self.group_kinds or ("full",) * len(self.groups):
            if kind.startswith("sliding"):
                kept.append(max(0, end - int(kind.removeprefix("sliding")) + 1
                                - self.retained_tokens))
            elif kind.startswith("local"):
                size = int(kind.removeprefix("local"))
                kept.append(end // size * size)
            else:
                kept.append(0)
        return kept

    def bytes_needed(self, chunk: int, end: int) -> int:
        """Bytes of chunk ``chunk`` a load up to token ``end`` fills: the parts of the groups
        that keep a block of it (a block whose tokens all lie before ``kept_from`` is vLLM's
        null block)."""
        stop = (chunk + 1) * self.chunk_tokens
        last_block = (min(stop, max(end, 1)) - 1) // self.block_tokens * self.block_tokens
        sizes = self.part_bytes or (self.chunk_bytes,)
        return sum(size for size, first in zip(sizes, self.kept_from(end), strict=True)
                   if last_block + self.block_tokens > first)

    def groups_filled(self, block_ids: tuple[int, ...]) -> tuple[int, ...] | None:
        """The KV cache groups a chunk's load fills (``block_ids``: each group's blocks, group
        after group; ``NULL_BLOCK`` where a group keeps none), when not all of them; None
        when every group needs its part (or the model has one group)."""
        groups = len(self.groups)
        if groups < 2:
            return None
        per = len(block_ids) // groups
        filled = tuple(g for g in range(groups)
                       if any(b != NULL_BLOCK for b in block_ids[g * per:(g + 1) * per]))
        return filled if len(filled) < groups else None

    def namespace(self, model: str, revision: str, tp_size: int, tp_rank: int,
                  settings: str = "") -> Namespace:
        layout = f"{LAYOUT_NAME}:{self.num_layers}x{self.page_shape}"
        if self.page_order != "HNC":  # tokens outside heads: other bytes in a page
            layout += f":{self.page_order}"
        if len(self.groups) > 1:  # which layers hold what, in chunk order
            layout += ":" + "+".join(f"{n}{kind}" for n, kind in zip(self.groups, self.group_kinds,
                                                                     strict=True))
        return Namespace(
            model=model, model_revision=revision, kv_dtype=self.kv_dtype,
            layout=layout,
            layout_version=LAYOUT_VERSION, block_tokens=self.block_tokens,
            chunk_tokens=self.chunk_tokens, tp_size=tp_size, tp_rank=tp_rank,
            model_settings=settings)


def geometry_from_vllm(vllm_config, kv_cache_config, config: KVTierConfig) -> KVGeometry:
    """Build the geometry from vLLM's configs; ``ConfigError`` for what kvtier cannot serve."""
    groups = kv_cache_config.kv_cache_groups
    model = vllm_config.model_config.model
    kinds = [_group_kind(model, i, group) for i, group in enumerate(groups)]
    specs = [group.kv_cache_spec for group in groups]
    spec = specs[0]
    if len({(s.block_size, s.page_size_bytes) for s in specs}) != 1:
        raise ConfigError(
            f"kvtier: the KV cache groups of {model} have different block sizes or page sizes "
            f"({', '.join(f'{s.block_size} tokens / {s.page_size_bytes} bytes' for s in specs)}); "
            "kvtier stores every group's pages of a chunk together and needs them alike")
    block = spec.block_size
    if config.chunk_tokens % block:
        config.check_block_tokens(block)
    hash_block = getattr(kv_cache_config, "hash_block_size", None) or block
    if config.chunk_tokens % hash_block:
        config.check_block_tokens(hash_block)
    _check_parallel(vllm_config.parallel_config)
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    shapes = {_page_shape(s, cache_dtype) for s in specs}
    if len(shapes) != 1:
        raise ConfigError(f"kvtier: the KV cache groups of {model} lay their pages out "
                          f"differently ({', '.join(sorted(shapes))}); kvtier needs one page shape")
    return KVGeometry(
        num_layers=sum(len(g.layer_names) for g in groups), page_bytes=spec.page_size_bytes,
        block_tokens=block, hash_block_tokens=hash_block, chunk_tokens=config.chunk_tokens,
        kv_dtype=str(spec.dtype).removeprefix("torch."), page_shape=shapes.pop(),
        group_layers=tuple(len(g.layer_names) for g in groups) if len(groups) > 1 else (),
        layer_names=tuple(name for g in groups for name in g.layer_names), group_kinds=tuple(kinds),
        page_order=_page_order(getattr(kv_cache_config, "kv_cache_layout", None)),
        retained_tokens=max(int(getattr(s, "extra_retained_tokens", 0) or 0) for s in specs),
        kv_run=kv_run(spec), value_dtype=value_dtype(spec, cache_dtype),
        reference_cpu_mla=is_reference_cpu_mla(vllm_config, config.verify_sample))


def _check_parallel(parallel) -> None:
    """``ConfigError`` for a way of splitting the model over ranks that kvtier cannot serve:
    its chunks hold every layer of a rank, cover ``chunk_tokens`` of blocks of
    ``block_size`` tokens, and count as stored when every rank of one tensor-parallel
    group has them."""
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError(
            "kvtier: pipeline parallelism is not supported: each pipeline stage holds only its "
            "own layers, while kvtier's chunks hold every layer of a rank and count a chunk "
            "stored when every rank of one tensor-parallel group has it; serve with "
            "tensor_parallel_size instead of pipeline_parallel_size")
    dcp = getattr(parallel, "decode_context_parallel_size", 1)
    if dcp > 1:
        raise ConfigError(
            f"kvtier: decode context parallelism (decode_context_parallel_size = {dcp}) is not "
            f"supported: a block then spans {dcp} x block_size tokens, each rank keeping its "
            "share of them (cp_kv_cache_interleave_size at a time), while kvtier maps a "
            "chunk's tokens onto blocks of block_size tokens and would store and load the "
            "wrong pages; serve with decode_context_parallel_size = 1")
    pcp = getattr(parallel, "prefill_context_parallel_size", 1)
    if pcp > 1:
        raise ConfigError(
            f"kvtier: prefill context parallelism (prefill_context_parallel_size = {pcp}) is "
            f"not supported: {pcp} workers would then write each tensor-parallel rank's copy "
            "of a chunk under one namespace, while kvtier's scheduler side counts a chunk "
            "stored when tensor_parallel_size workers reported it; serve with "
            "prefill_context_parallel_size = 1")


def _page_order(layout_name: str | None) -> str:
    """The order of a page's dims in memory under vLLM's ``KVCacheLayout`` ``layout_name``
    ("HNC": heads, then tokens, then content; "NHC": tokens outside heads). A page's bytes
    in a chunk are its memory bytes, so the order is part of the namespace."""
    if layout_name is None:
        return "HNC"  # before vLLM named its layouts, pages were heads outside tokens
    from vllm.v1.kv_cache_layout import KVCacheLayout

    try:
        layout = KVCacheLayout[layout_name]
    except KeyError:
        raise ConfigError(f"kvtier: vLLM's KV cache layout {layout_name!r} is not one kvtier "
                          f"knows ({', '.join(m.name for m in KVCacheLayout)}); upgrade kvtier or "
                          "set VLLM_KV_CACHE_LAYOUT to one of those") from None
    return "".join("LBHNC"[axis] for axis in layout.value if axis >= 2)


def _page_shape(spec, cache_dtype: str = "auto") -> str:
    """What a page holds, for the namespace: block, heads, head size and dtype; then, where
    the attention backend packs pages otherwise (heads or states merged, inline scales,
    padding, a quantized cache), the page's logical shape in bytes and what differs."""
    dtype = str(spec.dtype).removeprefix("torch.")
    shape = f"{spec.block_size}x{spec.num_kv_heads}x{spec.head_size}x{dtype}"
    kv_parts = 1 if type(spec).__name__.startswith("MLA") else 2  # one latent, or K and V
    plain = (spec.num_kv_heads, spec.block_size,
             kv_parts * spec.head_size * spec.dtype.itemsize)
    logical = (getattr(spec, "num_heads", plain[0]),
               spec.get_num_kernel_states(spec.block_size) if hasattr(spec, "get_num_kernel_states")
               else plain[1], getattr(spec, "state_content_size_bytes", plain[2]))
    quant = int(getattr(spec, "kv_quant_mode", 0) or 0)
    if logical != plain or spec.page_size_bytes != math.prod(logical) or quant:
        shape += f":{'x'.join(map(str, logical))}B:page{spec.page_size_bytes}:quant{quant}"
    if cache_dtype != "auto":  # fp8 variants share a torch dtype
        shape += f":{cache_dtype}"
    return shape


def _group_kind(model: str, index: int, group) -> str:
    """What a KV cache group keeps, as named in the namespace; ``ConfigError`` for a group
    whose state is not paged attention KV."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    spec = group.kv_cache_spec
    where = f"KV cache group {index} of {model} ({len(group.layer_names)} layers, e.g. " \
            f"{group.layer_names[0]})"
    if getattr(group, "host_resident", False) or not getattr(group, "enable_kv_transfer", True):
        raise ConfigError(f"kvtier: {where} is host-resident or not transferable in vLLM; kvtier "
                          "stores every group of a chunk and cannot serve this model yet")
    if type(spec) is SlidingWindowSpec:
        return f"sliding{spec.sliding_window}"
    if type(spec) is ChunkedLocalAttentionSpec:
        return f"local{spec.attention_chunk_size}"
    if type(spec) is FullAttentionSpec:
        return "full"
    if type(spec) is MLAAttentionSpec:  # one latent page per block and layer
        return "mla"
    raise ConfigError(
        f"kvtier: {where} keeps {type(spec).__name__} state, not paged attention KV "
        "(full, sliding-window or chunked local attention); kvtier cannot store it. Serve "
        "this model without kvtier.")


def say_unstored_replies(geometry: KVGeometry) -> None:
    """Warn when chunks completed while decoding cannot be stored (a window's pages)."""
    unstored = geometry.unstored_replies()
    if unstored is not None:
        log.warning("kvtier: %s: a chunk completed while decoding has lost pages out of "
                    "that window and is not stored (prompts still are); to store replies "
                    "too, set chunk_tokens to a multiple of the block size (%d) that is "
                    "no longer than the window (that divides a local attention chunk)",
                    unstored, geometry.block_tokens)
