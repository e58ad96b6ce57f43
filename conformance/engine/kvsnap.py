"""KV-content snapshots of an engine's prefix cache, matched through vLLM's own hash map.

For every key of ``scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block``
(block hash + group id) the snapshot records the block(s) it maps to and, for every layer
of that KV-cache group, the block's values as float32 arrays:

* attention layers (CPU_ATTN): K and V of the token slots the block's primary hash covers.
  A partial block's other slots are scratch and legitimately schedule-dependent. The
  CPU_ATTN block is *not* token-major: per KV head it holds K transposed
  (head_size x block_size) followed by V (block_size x head_size) inside the logical
  (heads, block_size, 2*head_size) view. ``verify_cpu_attn_layout`` checks that with vLLM's
  own cache-write kernel before any snapshot relies on it;
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


def snapshot(llm: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Return (metadata, arrays) for every cached block of a running in-process engine."""
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    groups = sched.kv_cache_config.kv_cache_groups
    fwd_ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    pool = sched.kv_cache_manager.block_pool
    keys: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    token_dims: dict[str, int | None] = {}
    whole_block_layers: set[str] = set()
    for key, entry in _hash_map(pool).items():
        gid = int.from_bytes(key[-4:], "big")
        spec = groups[gid].kv_cache_spec
        kind = type(spec).__name__
        bs = int(spec.block_size)
        refs = []
        for blk in _blocks_of(entry):
            n = blk.block_hash_num_tokens
            if n is None:
                raise RuntimeError(f"cached block {blk.block_id} has no hash token count")
            refs.append(BlockRef(int(blk.block_id), int(n)))
            for layer in groups[gid].layer_names:
                tensors = _layer_states(fwd_ctx, layer)
                if kind in ATTENTION_KINDS and len(tensors) == 1 and _attn_backend_name(fwd_ctx, layer) == "CPU_ATTN":
                    t = tensors[0]
                    verify_cpu_attn_layout(t.dtype, bs, int(t.shape[-1]) // 2)
                    parts = split_cpu_attn_block(t[blk.block_id], valid_tokens(int(n), bs))
                elif kind in ATTENTION_KINDS:
                    # Unknown attention layout: whole blocks only (scratch slots included).
                    whole_block_layers.add(layer)
                    parts = [(t[blk.block_id], None) for t in tensors]
                else:
                    parts = [(t[blk.block_id], None) for t in tensors]
                for si, (part, tdim) in enumerate(parts):
                    token_dims[f"{layer}|{si}"] = tdim
                    name = f"b{blk.block_id}|{layer}|{si}"
                    if name not in arrays:
                        arrays[name] = part.detach().to("cpu").float().contiguous().numpy().copy()
        keys[key.hex()] = {
            "group": gid,
            "kind": kind,
            "block_size": bs,
            "layers": list(groups[gid].layer_names),
            "blocks": [[r.block_id, r.num_tokens] for r in refs],
        }
    meta = {
        "keys": keys,
        "token_dims": token_dims,
        "whole_block_layers": sorted(whole_block_layers),
        "num_arrays": len(arrays),
    }
    return meta, arrays


def corrupt_prefix_blocks(llm: Any, prefix_tokens: int) -> list[int]:
    """Negative control: add 1.0 to every attention layer of the cached blocks whose primary
    hash covers exactly ``prefix_tokens`` leading tokens. Returns the corrupted block IDs."""
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    groups = sched.kv_cache_config.kv_cache_groups
    fwd_ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    done: list[int] = []
    for key, entry in _hash_map(sched.kv_cache_manager.block_pool).items():
        gid = int.from_bytes(key[-4:], "big")
        if type(groups[gid].kv_cache_spec).__name__ not in ATTENTION_KINDS:
            continue
        for blk in _blocks_of(entry):
            if blk.block_hash_num_tokens != prefix_tokens or blk.block_id in done:
                continue
            for layer in groups[gid].layer_names:
                for t in _layer_states(fwd_ctx, layer):
                    t[blk.block_id] += 1.0
            done.append(int(blk.block_id))
    return done
