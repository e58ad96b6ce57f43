"""KV-content snapshots of an engine's prefix cache, matched through vLLM's own hash map.

Two halves, one per process of a multiprocess engine. The EngineCore half
(`cached_blocks`) walks ``scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block``
(block hash + group id) and lists the block(s) every key maps to; the worker half
(`read_blocks`, run on every rank through vLLM's ``collective_rpc``) returns, for every
layer of that KV-cache group, the block's values as float32 arrays:

* attention layers (CPU_ATTN): K and V of the token slots the block's primary hash covers,
  each as (heads, valid tokens, head_size). A partial block's other slots are scratch and
  legitimately schedule-dependent. The CPU_ATTN block is *not* token-major, and its layout
  depends on the ISA vLLM's kernel runs (K transposed then V per head for "vec"/"vec16",
  pair-interleaved tiles for "amx", ...). kvsnap assumes none of them: it derives, once per
  `CpuAttnGeometry` (dtype, ISA, block size, head size, KV heads), the flat slot of every
  (K|V, head, token, dim) by writing index-encoding K/V with vLLM's own cache-write kernel
  (`derive_cpu_attn_layout`); a write that is not a bijection onto the block's slots, or
  random K/V that do not read back through the map, raise `CpuAttnLayoutError`;
* attention layers on CUDA (FLASH_ATTN, TRITON_ATTN): vLLM's logical per-layer view is
  (kernel blocks, heads, kernel block size, 2*head_size), K and V packed in the last axis;
  a hybrid's scheduler block may span several kernel blocks (`attention_block`). K and V of
  the covered token slots, as on the CPU;
* Mamba/GDN layers: each recurrent-state view of the block, whole.

Invariants:
* Keys are hex strings of vLLM's ``BlockHashWithGroupId`` bytes; with PYTHONHASHSEED fixed
  they are equal across processes for equal token prefixes, which is what lets two engines'
  blocks be matched.
* Array names are ``b<block_id>|<layer>|<state>`` (attention: state 0 = K, 1 = V); each
  (block, layer) is stored once even when several keys (aliases) point at the block.
  ``token_dims["<layer>|<state>"]`` names the token axis (None: recurrent state); K and V
  of every attention layout put tokens on axis 1.
* bf16/fp16 values are widened to float32 (exact), so byte equality of the arrays is equality
  of the original values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

ATTENTION_KINDS = ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec")


@dataclass(frozen=True)
class BlockRef:
    block_id: int
    num_tokens: int  # tokens covered by the block's primary hash


def _hash_map(block_pool: Any) -> dict[bytes, Any]:
    hm = block_pool.cached_block_hash_to_block
    cache = getattr(hm, "_cache", None)
    if not isinstance(cache, dict):
        raise TypeError("BlockHashToBlockMap._cache not found: update kvsnap for this vLLM version")
    return cache


def _blocks_of(entry: Any) -> list[Any]:
    return list(entry.values()) if isinstance(entry, dict) else [entry]


def _layer_states(fwd_ctx: dict[str, Any], layer: str) -> list[Any]:
    kv = fwd_ctx[layer].kv_cache
    return list(kv) if isinstance(kv, (list, tuple)) else [kv]


def valid_tokens(num_tokens: int, block_size: int) -> int:
    """Token slots of the last block of a ``num_tokens`` prefix that the prefix covers."""
    return num_tokens - ((num_tokens - 1) // block_size) * block_size


class CpuAttnLayoutError(RuntimeError):
    """vLLM's CPU_ATTN cache write is not a bijection of (K|V, head, token, dim) onto the slots
    of one block, or a write does not read back exactly through the map derived from it."""


@dataclass(frozen=True)
class CpuAttnGeometry:
    """What a CPU_ATTN block layout may depend on; the key of the derived-layout cache."""

    dtype: Any  # torch dtype of the cache (== of the K/V the kernel is given)
    isa: str  # vLLM's CPU attention ISA ("vec", "vec16", "amx", "neon", ...)
    block_size: int
    head_size: int
    heads: int  # KV heads of the layer (of this rank)

    def __str__(self) -> str:
        return (f"isa {self.isa}, {self.dtype}, block_size {self.block_size}, "
                f"head_size {self.head_size}, {self.heads} KV heads")


#: ``write(key, value, block, isa)``: K/V (tokens, heads, head_size), token t into slot t of one
#: (heads, block_size, 2*head_size) block. The one seam between kvsnap and vLLM's kernel.
CacheWrite = Callable[[Any, Any, Any, str], None]


def vllm_cache_write(key: Any, value: Any, block: Any, isa: str) -> None:
    """vLLM's own ``cpu_attn_reshape_and_cache`` into one block, through the K/V halves that
    ``CPUAttentionBackendImpl.do_kv_cache_update`` cuts from the layer cache."""
    import torch
    from vllm import _custom_ops as ops

    heads, block_size, _ = block.shape
    key_cache, value_cache = block.unsqueeze(0).view(1, heads, 2 * block_size, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(key.shape[0]), isa)


_DIGIT_BITS = 8  # index digits 0..255, written as 1..256: exact in bf16 (8 significant bits) and wider
_INDEX_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")
_layouts: dict[CpuAttnGeometry, Any] = {}


def _write_block(geom: CpuAttnGeometry, kv: Any, write: CacheWrite) -> Any:
    """Write ``kv`` (2, heads, block_size, head_size) into a zeroed block; the block, flat."""
    import torch

    block = torch.zeros(geom.heads, geom.block_size, 2 * geom.head_size, dtype=geom.dtype)
    k, v = (kv[i].to(geom.dtype).transpose(0, 1).contiguous() for i in (0, 1))
    write(k, v, block, geom.isa)
    return block.reshape(-1)


def _slot_contents(geom: CpuAttnGeometry, write: CacheWrite) -> Any:
    """Which element index ``((kind*heads + head)*block_size + token)*head_size + dim`` each
    flat slot of the block receives, one base-256 digit per write.

    Every write carries digit+1, so a slot still 0 was not written: each pass is also the
    written-slots mark, and the passes must agree on it."""
    import torch

    n = 2 * geom.heads * geom.block_size * geom.head_size
    ids = torch.arange(n, dtype=torch.int64).view(2, geom.heads, geom.block_size, geom.head_size)
    contents = torch.zeros(n, dtype=torch.int64)
    marks = []
    for p in range(max(1, -(-(n - 1).bit_length() // _DIGIT_BITS))):
        shift = p * _DIGIT_BITS
        got = _write_block(geom, ((ids >> shift) & 255) + 1, write).to(torch.int64)
        marks.append(got > 0)
        contents += (got - 1).clamp(min=0) << shift
    written = marks[0]
    if not all(torch.equal(m, written) for m in marks[1:]):
        raise CpuAttnLayoutError(f"CPU_ATTN cache write ({geom}) writes different slots on each write")
    unwritten = n - int(written.sum())
    counts = torch.bincount(contents[written].clamp(max=n), minlength=n + 1)[:n]  # n: no element's index
    nowhere, repeated = int((counts == 0).sum()), int((counts > 1).sum())
    if unwritten or nowhere or repeated:
        raise CpuAttnLayoutError(
            f"CPU_ATTN cache write ({geom}) is not a bijection onto the block's {n} slots: {unwritten} slots "
            f"never written, {nowhere} elements in no slot, {repeated} in several; update kvsnap")
    return contents


def check_cpu_attn_layout(geom: CpuAttnGeometry, layout: Any, write: CacheWrite = vllm_cache_write) -> None:
    """Raise unless random K/V written by ``write`` read back exactly through ``layout``."""
    import torch

    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, geom.heads, geom.block_size, geom.head_size, generator=gen).to(geom.dtype)
    if not torch.equal(_write_block(geom, kv, write)[layout], kv):
        raise CpuAttnLayoutError(f"random K/V written by the CPU_ATTN cache write ({geom}) do not read "
                                 "back through the derived slot map; update kvsnap")


def derive_cpu_attn_layout(geom: CpuAttnGeometry, write: CacheWrite = vllm_cache_write) -> Any:
    """The block layout as vLLM's cache write makes it: an int64 (2, heads, block_size, head_size)
    tensor, ``[kind, head, token, dim]`` = flat slot of that K (kind 0) or V (kind 1) element in
    a contiguous (heads, block_size, 2*head_size) block. Checked by a random round trip."""
    import torch

    if str(geom.dtype) not in _INDEX_DTYPES:
        raise CpuAttnLayoutError(f"CPU_ATTN cache of {geom.dtype} ({geom}) cannot carry exact index digits "
                                 "(a quantized KV cache?); kvsnap reads float caches only")
    contents = _slot_contents(geom, write)
    layout = torch.empty_like(contents)
    layout[contents] = torch.arange(contents.numel())
    layout = layout.view(2, geom.heads, geom.block_size, geom.head_size)
    check_cpu_attn_layout(geom, layout, write)
    return layout


def cpu_attn_layout(geom: CpuAttnGeometry) -> Any:
    """``derive_cpu_attn_layout`` with vLLM's kernel, once per geometry and process."""
    if geom not in _layouts:
        _layouts[geom] = derive_cpu_attn_layout(geom)
    return _layouts[geom]


def split_cpu_attn_block(block: Any, valid: int, layout: Any) -> list[tuple[Any, int | None]]:
    """[(K (heads, valid, head_size), token axis 1), (V (heads, valid, head_size), token axis 1)]
    of one CPU_ATTN block, gathered through its derived ``layout``."""
    if not block.is_contiguous():
        raise CpuAttnLayoutError(f"CPU_ATTN block with strides {tuple(block.stride())} is not contiguous: "
                                 "its slots are not the derived layout's flat positions")
    flat = block.reshape(-1)
    return [(flat[layout[0, :, :valid]], 1), (flat[layout[1, :, :valid]], 1)]


def _cpu_attn_geometry(fwd_ctx: dict[str, Any], layer: str, t: Any) -> CpuAttnGeometry:
    """The layer cache's geometry and the ISA its writes use (the impl's own choice, as vLLM
    picks it with the model dtype and the cache config's block size)."""
    heads, block_size, head_size = int(t.shape[1]), int(t.shape[2]), int(t.shape[3]) // 2
    isa = getattr(getattr(fwd_ctx[layer], "impl", None), "isa", None)
    if not isinstance(isa, str):
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(t.dtype, block_size, head_size)
    return CpuAttnGeometry(t.dtype, isa, block_size, head_size, heads)


def _attn_backend_name(fwd_ctx: dict[str, Any], layer: str) -> str:
    backend = getattr(fwd_ctx[layer], "attn_backend", None)
    return str(backend.get_name()) if backend is not None else "?"


@dataclass(frozen=True)
class BlockRead:
    """One (block, layer) the worker is asked to read: sent over ``collective_rpc``."""

    block_id: int
    layer: str
    kind: str  # KV spec class name of the layer's group
    block_size: int
    num_tokens: int  # tokens the block's primary hash covers


def cached_blocks(scheduler: Any) -> tuple[dict[str, dict[str, Any]], list[BlockRead]]:
    """EngineCore side: every prefix-cache key, and the (block, layer) reads it needs."""
    groups = scheduler.kv_cache_config.kv_cache_groups
    keys: dict[str, dict[str, Any]] = {}
    reads: dict[tuple[int, str], BlockRead] = {}
    for key, entry in _hash_map(scheduler.kv_cache_manager.block_pool).items():
        gid = int.from_bytes(key[-4:], "big")
        spec = groups[gid].kv_cache_spec
        kind, bs = type(spec).__name__, int(spec.block_size)
        refs = []
        for blk in _blocks_of(entry):
            if blk.block_hash_num_tokens is None:
                raise RuntimeError(f"cached block {blk.block_id} has no hash token count")
            ref = BlockRef(int(blk.block_id), int(blk.block_hash_num_tokens))
            refs.append(ref)
            for layer in groups[gid].layer_names:
                # Each (block, layer) is read once even when several keys alias the block.
                reads.setdefault((ref.block_id, layer), BlockRead(ref.block_id, layer, kind, bs, ref.num_tokens))
        keys[key.hex()] = {
            "group": gid,
            "kind": kind,
            "block_size": bs,
            "layers": list(groups[gid].layer_names),
            "blocks": [(r.block_id, r.num_tokens) for r in refs],
        }
    return keys, list(reads.values())


#: CUDA attention backends whose layer cache is the packed (blocks, heads, block, 2*head_size) view.
PACKED_HND_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")


def attention_block(t: Any, block_id: int, block_size: int) -> Any:
    """One scheduler block of a packed CUDA attention cache, as (heads, block_size, 2*head_size).

    vLLM may run the kernel on blocks smaller than the scheduler's (a hybrid's attention block
    is enlarged to the Mamba page; the kernel keeps its own): block ``b`` is then kernel blocks
    ``b*r .. b*r+r-1`` with ``r = block_size / kernel block``, concatenated along the tokens.
    """
    kernel_block = int(t.shape[2])
    if t.dim() != 4 or block_size % kernel_block or t.shape[3] % 2:
        raise RuntimeError(f"attention cache {tuple(t.shape)} is not a packed HND view of {block_size}-token blocks")
    r = block_size // kernel_block
    part = t[block_id * r : (block_id + 1) * r]  # (r, heads, kernel_block, 2d)
    return part.permute(1, 0, 2, 3).reshape(part.shape[1], block_size, part.shape[3])


def split_packed_block(block: Any, valid: int) -> list[tuple[Any, int | None]]:
    """[(K (heads, valid, head_size), token axis 1), (V (heads, valid, head_size), token axis 1)]."""
    d = int(block.shape[-1]) // 2
    return [(block[:, :valid, :d], 1), (block[:, :valid, d:], 1)]


def _block_parts(fwd_ctx: dict[str, Any], read: BlockRead) -> tuple[list[tuple[Any, int | None]], bool]:
    """The arrays of one (block, layer) and their token axes; True if whole blocks only."""
    tensors = _layer_states(fwd_ctx, read.layer)
    backend = _attn_backend_name(fwd_ctx, read.layer) if read.kind in ATTENTION_KINDS else ""
    valid = valid_tokens(read.num_tokens, read.block_size)
    if len(tensors) == 1 and backend == "CPU_ATTN":
        t = tensors[0]
        geom = _cpu_attn_geometry(fwd_ctx, read.layer, t)
        if geom.block_size != read.block_size:
            raise CpuAttnLayoutError(f"CPU_ATTN cache of {read.layer} has {geom.block_size}-token blocks, "
                                     f"its KV spec {read.block_size}")
        return split_cpu_attn_block(t[read.block_id], valid, cpu_attn_layout(geom)), False
    if len(tensors) == 1 and backend in PACKED_HND_BACKENDS:
        return split_packed_block(attention_block(tensors[0], read.block_id, read.block_size), valid), False
    # Recurrent states whole; an unknown attention layout whole too (scratch slots included).
    return [(t[read.block_id], None) for t in tensors], read.kind in ATTENTION_KINDS


def read_blocks(worker: Any, reads: list[BlockRead]) -> dict[str, Any]:
    """Worker side (runs on every rank through ``collective_rpc``): this rank's KV arrays.

    Returns ``{"arrays": {"b<id>|<layer>|<state>": float32 array}, "token_dims": {...},
    "whole_block_layers": [...]}``; bf16/fp16 are widened to float32 exactly.
    """
    fwd_ctx = worker.vllm_config.compilation_config.static_forward_context
    arrays: dict[str, np.ndarray] = {}
    token_dims: dict[str, int | None] = {}
    whole: set[str] = set()
    for read in reads:
        parts, whole_block = _block_parts(fwd_ctx, read)
        if whole_block:
            whole.add(read.layer)
        for si, (part, tdim) in enumerate(parts):
            token_dims[f"{read.layer}|{si}"] = tdim
            arrays[f"b{read.block_id}|{read.layer}|{si}"] = part.detach().to("cpu").float().contiguous().numpy().copy()
    return {"arrays": arrays, "token_dims": token_dims, "whole_block_layers": sorted(whole)}


def corrupt_blocks(worker: Any, block_layers: list[tuple[int, str, int]]) -> None:
    """Worker side: add 1.0 to every KV state of the given (block, attention layer, block size)."""
    fwd_ctx = worker.vllm_config.compilation_config.static_forward_context
    for block_id, layer, block_size in block_layers:
        for t in _layer_states(fwd_ctx, layer):
            if _attn_backend_name(fwd_ctx, layer) in PACKED_HND_BACKENDS:
                r = block_size // int(t.shape[2])
                t[block_id * r : (block_id + 1) * r] += 1.0
            else:
                t[block_id] += 1.0


def prefix_blocks(scheduler: Any, prefix_tokens: int) -> list[tuple[int, str, int]]:
    """EngineCore side: (block, attention layer, block size) of the cached blocks whose primary
    hash covers exactly ``prefix_tokens`` leading tokens (the negative KV control's target)."""
    groups = scheduler.kv_cache_config.kv_cache_groups
    out: dict[tuple[int, str, int], None] = {}
    for key, entry in _hash_map(scheduler.kv_cache_manager.block_pool).items():
        gid = int.from_bytes(key[-4:], "big")
        if type(groups[gid].kv_cache_spec).__name__ not in ATTENTION_KINDS:
            continue
        for blk in _blocks_of(entry):
            if blk.block_hash_num_tokens == prefix_tokens:
                bs = int(groups[gid].kv_cache_spec.block_size)
                out.update(((int(blk.block_id), layer, bs), None) for layer in groups[gid].layer_names)
    return list(out)
