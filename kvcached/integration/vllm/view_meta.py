"""Byte-page metadata on the runner's KV views, and the 0.26-0.28 reshape seams that attach it.

Every KV view vLLM's runner holds carries `kvcached.views.BytePageMeta` (`attach_meta`),
which block copies (`copies`) and kvcached's page mapping rely on. The 0.29+ allocation
(`allocation`) attaches it to the views it builds itself; before 0.29 the reshape seam does:

``GPUModelRunner._reshape_kv_cache_tensors`` (``Capabilities.allocate_kv_cache`` false)
    Runs vLLM's own reshape (including its in-place hybrid restride), then attaches
    metadata to every view it returns, list elements included (0.26 Mamba state lists).
    The block dimension comes from the attention backend (``get_kv_cache_block_dim``, as
    vLLM's hybrid restride uses) or is 0 for Mamba. Disabled, it is vLLM's reshape alone.

``vllm.v1.worker.gpu.attn_utils._reshape_kv_cache`` (Model Runner V2, 0.26-0.28)
    The same for V2's module function (`annotate_views` is the one definition); layers
    sharing another's KV alias its views, so they carry its metadata.

Invariants:

* a view over a kvcached range keeps block ``b`` inside bytes ``[b*stride, (b+1)*stride)`` of
  its range (`check_block_row`): page mapping is per block row, so a view reaching outside
  its row (an unrestrided split K/V layout) would touch unmapped pages;
* metadata is attached all or nothing: only once every view of the call described and
  checked out;
* a view that cannot be described is an `IntegrationError` naming its layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kvcached.errors import CopyValidationError, IntegrationError
from kvcached.integration.vllm import install_state
from kvcached.integration.vllm.capabilities import Capabilities
from kvcached.integration.vllm.rank_kv import block_strides
from kvcached.views import BytePageMeta, attach_meta, describe_block_view

__all__ = ["annotate_views", "check_block_row", "describe_layer_view", "wrap_reshape", "wrap_reshape_v2"]


def _layer_block_dims(groups: Iterable[Any], kernel_block_sizes: Sequence[int],
                      cache_dtype: str) -> tuple[dict[str, int], set[str]]:
    """Block dimension of each layer's view, and the names of the Mamba layers (``groups``:
    the runner's attention groups, flattened)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    dims: dict[str, int] = {}
    mamba: set[str] = set()
    for group in groups:
        if group.kv_cache_group_id >= len(kernel_block_sizes):
            continue  # vLLM's trailing group of layers without KV cache
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            dims.update(dict.fromkeys(group.layer_names, 0))
            mamba.update(group.layer_names)
        elif isinstance(spec, AttentionSpec):
            dim = group.backend.get_kv_cache_block_dim(
                kernel_block_sizes[group.kv_cache_group_id],
                spec.num_kv_heads,
                spec.head_size,
                cache_dtype_str=cache_dtype,
            )
            dims.update(dict.fromkeys(group.layer_names, int(dim)))
    return dims, mamba


def describe_layer_view(name: str, view: torch.Tensor, num_blocks: int, block_dim: int | None) -> BytePageMeta:
    """`describe_block_view` for layer ``name``, failing as an `IntegrationError` that names it."""
    try:
        return describe_block_view(view, num_blocks, block_dim=block_dim)
    except CopyValidationError as exc:
        raise IntegrationError(f"layer {name}: cannot describe its KV view: {exc}") from exc


def check_block_row(name: str, meta: BytePageMeta, stride: int) -> None:
    """Block b of a view over a kvcached range must lie in bytes [b*stride, (b+1)*stride)."""
    end = meta.backing_offset + meta.segments[-1][0] + meta.segments[-1][1]
    if meta.block_stride != stride or end > stride:
        raise IntegrationError(
            f"layer {name}: its view's logical block covers bytes [{meta.backing_offset}, {end}) "
            f"with block stride {meta.block_stride}, outside the {stride}-byte block row kvcached "
            "maps pages for (a K/V-first layout that was not restrided blocks-first?)"
        )


def annotate_views(kv_caches: dict[str, Any], num_blocks: int, groups: Iterable[Any],
                   kernel_block_sizes: Sequence[int], cache_dtype: str, caps: Capabilities) -> None:
    """Attach byte-page metadata to every view vLLM's reshape returned (lists included)."""
    dims, mamba = _layer_block_dims(groups, kernel_block_sizes, cache_dtype)
    strides = block_strides()
    pending: list[tuple[torch.Tensor, BytePageMeta]] = []
    for name, entry in kv_caches.items():
        is_list = isinstance(entry, (list, tuple))
        if name in mamba and is_list == caps.raw_mamba_pages:
            want = "one raw page tensor" if caps.raw_mamba_pages else "a list of state tensors"
            raise IntegrationError(f"Mamba layer {name}: vLLM {caps.version} should hold {want}")
        for t in entry if is_list else (entry,):
            meta = describe_layer_view(name, t, num_blocks, dims.get(name))
            stride = strides.get(meta.backing_id)
            if stride is not None:
                check_block_row(name, meta, stride)
            pending.append((t, meta))
    for t, meta in pending:  # all or nothing
        attach_meta(t, meta)


def wrap_reshape(original: Callable[..., Any]) -> Callable[..., Any]:
    """The reshape seam over vLLM's ``_reshape_kv_cache_tensors`` (``original``)."""

    @functools.wraps(original)
    def _reshape_kv_cache_tensors(
        self: Any, kv_cache_raw_tensors: dict[str, torch.Tensor], kernel_block_sizes: list[int]
    ) -> dict[str, Any]:
        kv_caches: dict[str, Any] = original(self, kv_cache_raw_tensors, kernel_block_sizes)
        state = install_state.current()
        if state is not None and state.enabled:
            annotate_views(kv_caches, int(self.kv_cache_config.num_blocks), self._kv_cache_spec_attn_group_iterator(),
                           kernel_block_sizes, self.cache_config.cache_dtype, state.caps)
        return kv_caches

    return _reshape_kv_cache_tensors


def wrap_reshape_v2(original: Callable[..., Any]) -> Callable[..., Any]:
    """The reshape seam over Model Runner V2's ``gpu.attn_utils._reshape_kv_cache``: the same
    annotation; layers sharing another's KV alias its views, and so its metadata."""

    @functools.wraps(original)
    def _reshape_kv_cache(attn_groups: Sequence[Any], kv_cache_raw_tensors: dict[str, torch.Tensor],
                          cache_dtype: str, kernel_block_sizes: list[int], shared_kv_cache_layers: dict[str, str],
                          kv_cache_config: Any = None) -> dict[str, Any]:
        kv_caches: dict[str, Any] = original(attn_groups, kv_cache_raw_tensors, cache_dtype, kernel_block_sizes,
                                             shared_kv_cache_layers, kv_cache_config)
        state = install_state.current()
        if state is not None and state.enabled:
            if kv_cache_config is None:  # every 0.26-0.28 caller passes it; the block count is there
                raise IntegrationError("Model Runner V2 reshaped KV views without a KV cache config")
            annotate_views(kv_caches, int(kv_cache_config.num_blocks), attn_groups, kernel_block_sizes,
                           cache_dtype, state.caps)
        return kv_caches

    return _reshape_kv_cache
