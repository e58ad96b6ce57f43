"""KV-content snapshots of an engine's prefix cache, matched through vLLM's own hash map.

Two halves, one per process of a multiprocess engine. The EngineCore half
(`cached_blocks`) walks ``scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block``
(block hash + group id) and lists the block(s) every key maps to; the worker half
(`read_blocks`, run on every rank through vLLM's ``collective_rpc``) returns, for every
layer of that KV-cache group, the block's values as float32 arrays:

* attention layers (CPU_ATTN): K and V of the token slots the block's primary hash covers.
  A partial block's other slots are scratch and legitimately schedule-dependent. The
  CPU_ATTN block is *not* token-major: per KV head it holds K transposed
  (head_size x block_size) followed by V (block_size x head_size) inside the logical
  (heads, block_size, 2*head_size) view. ``verify_cpu_attn_layout`` checks that with vLLM's
  own cache-write kernel before any snapshot relies on it;
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
  ``token_dims["<layer>|<state>"]`` names the token axis (None: recurrent state).
* bf16 values are widened to float32 (exact), so byte equality of the arrays is equality
  of the original values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

ATTENTION_KINDS = ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec")
_verified: set[tuple[str, int, int, int]] = set()


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


def split_cpu_attn_block(block: Any, valid: int) -> list[tuple[Any, int | None]]:
    """[(K (heads, head_size, valid), token axis 2), (V (heads, valid, head_size), token axis 1)]."""
    heads, block_size, two_d = block.shape
    d = two_d // 2
    flat = block.reshape(heads, block_size * two_d)
    k = flat[:, : block_size * d].reshape(heads, d, block_size)[:, :, :valid]
    v = flat[:, block_size * d :].reshape(heads, block_size, d)[:, :valid, :]
    return [(k, 2), (v, 1)]


def verify_cpu_attn_layout(dtype: Any, block_size: int, head_size: int, heads: int = 2) -> None:
    """Write random K/V with vLLM's CPU cache-write kernel and check ``split_cpu_attn_block``
    reads every token back exactly; raise if the kernel layout is not the assumed one."""
    key_ = (str(dtype), block_size, head_size, heads)
    if key_ in _verified:
        return
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size)
    cache = torch.zeros(1, heads, block_size, 2 * head_size, dtype=dtype)
    kc, vc = cache.view(1, heads, block_size * 2, head_size).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(block_size, heads, head_size, generator=gen).to(dtype)
    val = torch.randn(block_size, heads, head_size, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(key, val, kc, vc, torch.arange(block_size), isa)
    (k, _), (v, _) = split_cpu_attn_block(cache[0], block_size)
    if not (torch.equal(k, key.permute(1, 2, 0)) and torch.equal(v, val.permute(1, 0, 2))):
        raise RuntimeError(f"CPU_ATTN KV block layout is not K^T|V for isa {isa}; update kvsnap")
    _verified.add(key_)


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
        verify_cpu_attn_layout(t.dtype, read.block_size, int(t.shape[-1]) // 2)
        return split_cpu_attn_block(t[read.block_id], valid), False
    if len(tensors) == 1 and backend in PACKED_HND_BACKENDS:
        return split_packed_block(attention_block(tensors[0], read.block_id, read.block_size), valid), False
    # Recurrent states whole; an unknown attention layout whole too (scratch slots included).
    return [(t[read.block_id], None) for t in tensors], read.kind in ATTENTION_KINDS


def read_blocks(worker: Any, reads: list[BlockRead]) -> dict[str, Any]:
    """Worker side (runs on every rank through ``collective_rpc``): this rank's KV arrays.

    Returns ``{"arrays": {"b<id>|<layer>|<state>": float32 array}, "token_dims": {...},
    "whole_block_layers": [...]}``; bf16 is widened to float32 exactly.
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
