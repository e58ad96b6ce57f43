"""Allocation seams: vLLM's KV tensors, for both runner generations, over virtual ranges.

Where vLLM allocates KV tensors is the one worker difference between the series;
``Capabilities.allocate_kv_cache`` tells which seams `seams` returns. Both generations open
their backings and register them the same way (`backings`): only the null block's kv page
is mapped on return, and the space is published for the scheduler (`rank_kv`).

0.26-0.28 (``allocate_kv_cache`` false): ``GPUModelRunner._allocate_kv_cache_tensors``,
with ``_reshape_kv_cache_tensors`` (`view_meta`) after it
    Returns, per layer, an int8 tensor of exactly ``KVCacheTensor.size`` bytes, like
    vLLM's ``torch.zeros``, but over a `kvcached._vmm.VirtualRange`: one range per
    ``KVCacheTensor``, or one range for all packed tensors (``block_stride > 0``), which
    alias one backing exactly as in vLLM. The tensors must cover exactly the layers of the
    KV cache groups.

0.29+ (``allocate_kv_cache`` true): ``vllm.v1.worker.gpu_model_runner.allocate_kv_cache``
    The name the V1 runner imported from ``vllm.v1.worker.utils`` and calls from
    ``initialize_kv_cache_tensors`` (the runner methods above are gone). vLLM 0.29 places
    every layer in *one* backing buffer, each layer view ``[B, H, N, C]`` at ``offset +
    l*layer_stride + b*block_stride`` (``create_kv_cache_views``). kvcached runs vLLM's own
    function on the ``meta`` device, so vLLM's code decides every view's shape, strides,
    dtype and offset without allocating, then splits the buffer into its *regions*
    (`view_regions`: maximal ranges of overlapping views, one per layer slot for
    layer-outermost layouts such as the CPU backend's LBHNC, the whole buffer for
    block-outermost ones such as BLHNC), backs each region with its own range exactly like
    a 0.28 ``KVCacheTensor``, rebuilds every view with the same geometry over its region,
    and attaches `kvcached.views.BytePageMeta` (block dimension 0, as in every 0.29 view)
    with the same block-row check as the reshape seam. A layer slot that is not a whole
    number of kv pages therefore costs nothing: each region starts its own range.

``vllm.v1.worker.gpu.attn_utils._allocate_kv_cache`` (Model Runner V2, 0.26-0.28)
    V2's module function with the same contract as the runner method above (`allocate_raw_tensors`
    serves both); layers that share another layer's KV (``shared_layers``) get no tensor, as in
    vLLM. V2 builds no minimal profiling cache (its ``profile_cudagraph_memory`` is 0).

``vllm.v1.worker.gpu.attn_utils.allocate_kv_cache`` (Model Runner V2, 0.29+)
    The name V2's ``init_kv_cache`` imported from ``vllm.v1.worker.utils``: the same wrapper
    as V1's 0.29 name, so both runners' views come from one definition. V2 aliases shared
    layers and binds the views itself after the call (0.32 also maps them to kernel blocks,
    from the returned views); ``runner.kv_caches``, which its block copy reads, holds the
    returned views with their byte-page metadata. Its minimal profiling cache is marked by
    ``gpu.cudagraph_utils._init_minimal_kv_cache_for_profiling``, as V1's below.

``GPUModelRunner._init_minimal_kv_cache_for_profiling`` (every series)
    Marks the minimal KV cache vLLM builds to profile CUDA-graph memory. Dummy runs write
    into it before any pool exists, so it must be ordinary memory: while the mark is set
    (per thread, nesting restores the outer mark) the allocation seams delegate to vLLM and
    register nothing. (0.29 builds it through the same ``initialize_kv_cache`` and
    ``allocate_kv_cache``.)

Invariant: an allocation either returns tensors whose backings are registered, or raises
with every range and budget slot it opened closed again and nothing registered. Disabled
(`install_state`), every seam here is vLLM's own function.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcached.errors import IntegrationError
from kvcached.integration.vllm import install_state
from kvcached.integration.vllm.backings import device_string, open_backings, register
from kvcached.integration.vllm.capabilities import Capabilities
from kvcached.integration.vllm.patching import Seam, require_own, require_vllm_helper
from kvcached.integration.vllm.view_meta import check_block_row, describe_layer_view, wrap_reshape, wrap_reshape_v2
from kvcached.integration.vllm.view_regions import plan_regions, rebase
from kvcached.views import BytePageMeta, attach_meta

__all__ = ["allocate_kv_cache_tensors", "allocate_kv_cache_views", "seams"]

_profiling = threading.local()  # .active: inside _init_minimal_kv_cache_for_profiling


def _delegates() -> bool:
    """Whether an allocation seam leaves this call to vLLM: kvcached is off, or vLLM is
    building its minimal profiling cache."""
    return not install_state.is_enabled() or getattr(_profiling, "active", False)


# ---- 0.26-0.28: one range per KVCacheTensor ------------------------------------------------
@dataclass
class _BackingPlan:
    size: int  # bytes exposed to vLLM (the KVCacheTensor size)
    stride: int  # bytes per logical block
    layers: list[str]


def _plan_backings(kv_cache_config: Any) -> list[_BackingPlan]:
    """One backing per ``KVCacheTensor``, except that packed tensors share one."""
    num_blocks = int(kv_cache_config.num_blocks)
    if num_blocks <= 0:
        raise IntegrationError(f"KV cache config has num_blocks={num_blocks}")
    plans: list[_BackingPlan] = []
    packed: _BackingPlan | None = None
    for t in kv_cache_config.kv_cache_tensors:
        size, block_stride = int(t.size), int(t.block_stride)
        if block_stride > 0:
            if packed is None:
                packed = _BackingPlan(size, block_stride, [])
                plans.append(packed)
            elif (size, block_stride) != (packed.size, packed.stride):
                raise IntegrationError(
                    f"packed KV tensors disagree on the shared backing: size {size} / block "
                    f"stride {block_stride} vs {packed.size} / {packed.stride}"
                )
            if block_stride * num_blocks > size:
                raise IntegrationError(
                    f"packed KV tensor of {size} bytes cannot hold {num_blocks} blocks of {block_stride}"
                )
            packed.layers.extend(t.shared_by)
        else:
            if size % num_blocks:
                raise IntegrationError(
                    f"KV tensor of {size} bytes for {list(t.shared_by)} is not {num_blocks} equal blocks"
                )
            plans.append(_BackingPlan(size, size // num_blocks, list(t.shared_by)))
    if not plans:
        raise IntegrationError("KV cache config has no KV tensors")
    return plans


def _group_layers(kv_cache_config: Any) -> set[str]:
    return {n for g in kv_cache_config.kv_cache_groups for n in g.layer_names}


def allocate_raw_tensors(kv_cache_config: Any, device: Any, expected: set[str]) -> dict[str, torch.Tensor]:
    """int8 tensors of exactly ``KVCacheTensor.size`` bytes over virtual ranges, one per layer
    of ``expected`` (every layer the KV tensors must cover): vLLM's ``torch.zeros`` per
    ``KVCacheTensor``, kvcached's way. Only the null block's kv page is mapped on return."""
    plans = _plan_backings(kv_cache_config)
    backings = open_backings([p.stride for p in plans], [p.size for p in plans],
                             int(kv_cache_config.num_blocks), device_string(torch.device(device)))
    tensors = {name: rows for plan, rows in zip(plans, backings.rows, strict=True) for name in plan.layers}
    if expected != set(tensors):
        backings.close()
        raise IntegrationError(
            "KV tensors do not cover the KV cache groups' layers: missing "
            f"{sorted(expected - set(tensors))}, unexpected {sorted(set(tensors) - expected)}"
        )
    register(backings)
    return tensors


def allocate_kv_cache_tensors(runner: Any, kv_cache_config: Any) -> dict[str, torch.Tensor]:
    """kvcached's V1 ``_allocate_kv_cache_tensors``: every group's layer but the runner-only ones."""
    expected = _group_layers(kv_cache_config) - set(getattr(runner, "runner_only_attn_layers", ()))
    return allocate_raw_tensors(kv_cache_config, runner.device, expected)


def _wrap_allocate(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _allocate_kv_cache_tensors(self: Any, kv_cache_config: Any) -> dict[str, torch.Tensor]:
        if _delegates():
            return original(self, kv_cache_config)
        return allocate_kv_cache_tensors(self, kv_cache_config)

    return _allocate_kv_cache_tensors


def _wrap_allocate_v2(original: Callable[..., Any]) -> Callable[..., Any]:
    """Model Runner V2's ``_allocate_kv_cache``: layers that share another's KV (``shared_layers``)
    get no tensor of their own, as in vLLM."""

    @functools.wraps(original)
    def _allocate_kv_cache(kv_cache_config: Any, shared_layers: dict[str, str], device: Any) -> dict[str, torch.Tensor]:
        if _delegates():
            return original(kv_cache_config, shared_layers, device)
        return allocate_raw_tensors(kv_cache_config, device, _group_layers(kv_cache_config) - set(shared_layers))

    return _allocate_kv_cache


def _wrap_profiling(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _init_minimal_kv_cache_for_profiling(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(_profiling, "active", False)
        _profiling.active = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _profiling.active = outer

    return _init_minimal_kv_cache_for_profiling


# ---- 0.29+: one backing buffer, split into regions (allocate_kv_cache) -------------------------
def _views_over_regions(shapes: dict[str, torch.Tensor], regions: Sequence[Any],
                        rows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's ``meta`` views rebuilt, same geometry, over the rows of their regions' ranges."""
    tensors: dict[str, torch.Tensor] = {}
    for region, region_rows in zip(regions, rows, strict=True):
        for name in region.layers:
            like = shapes[name]
            tensors[name] = rebase(region_rows, like, int(like.storage_offset()) * like.element_size() - region.start)
    return tensors


def allocate_kv_cache_views(
    kv_cache_config: Any,
    device: Any,
    layout: Any,
    kernel_block_sizes: Sequence[int] | None,
    vllm_allocate: Callable[..., dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """kvcached's ``allocate_kv_cache`` (vLLM 0.29): vLLM's views, over virtual ranges.

    ``vllm_allocate`` is vLLM's function; it runs on the ``meta`` device, so its views
    carry the geometry and no memory. Only the null block's kv page is mapped on return.
    """
    num_blocks = int(kv_cache_config.num_blocks)
    if num_blocks <= 0:
        raise IntegrationError(f"KV cache config has num_blocks={num_blocks}")
    target = device_string(torch.device(device))
    shapes = vllm_allocate(kv_cache_config, torch.device("meta"), layout, kernel_block_sizes)
    if not shapes:
        return {}  # attention-free model: vLLM allocates nothing either
    regions = plan_regions(shapes, num_blocks)
    backings = open_backings([r.stride for r in regions], [num_blocks * r.stride for r in regions],
                             num_blocks, target)
    try:
        tensors = _views_over_regions(shapes, regions, backings.rows)
        pending: list[tuple[torch.Tensor, BytePageMeta]] = []
        for name, t in tensors.items():  # every 0.29 view is [B, H, N, C]: blocks are dimension 0
            meta = describe_layer_view(name, t, num_blocks, 0)
            check_block_row(name, meta, backings.strides[meta.backing_id])
            pending.append((t, meta))
    except BaseException:
        backings.close()
        raise
    for t, meta in pending:  # all or nothing: metadata only once every view checked out
        attach_meta(t, meta)
    register(backings)
    return tensors


def _wrap_allocate_views(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def allocate_kv_cache(
        kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes: list[int] | None = None
    ) -> dict[str, torch.Tensor]:
        if _delegates():
            return original(kv_cache_config, device, layout, kernel_block_sizes)
        return allocate_kv_cache_views(kv_cache_config, device, layout, kernel_block_sizes, original)

    return allocate_kv_cache


# ---- the seams ------------------------------------------------------------------------------
def seams(caps: Capabilities) -> list[Seam]:
    """The allocation seams of this vLLM generation, then the profiling mark, then Model Runner
    V2's where kvcached serves it (``Capabilities.model_runner_v2``); vLLM's shape checked."""
    from vllm.v1.worker import gpu_model_runner, utils

    runner = gpu_model_runner.GPUModelRunner
    allocation: list[Seam]
    if caps.allocate_kv_cache:
        allocation = [(gpu_model_runner, "allocate_kv_cache",
                       _wrap_allocate_views(require_vllm_helper(gpu_model_runner, "allocate_kv_cache", utils)))]
    else:
        allocation = [
            (runner, "_allocate_kv_cache_tensors", _wrap_allocate(require_own(runner, "_allocate_kv_cache_tensors"))),
            (runner, "_reshape_kv_cache_tensors", wrap_reshape(require_own(runner, "_reshape_kv_cache_tensors"))),
        ]
    profiling = require_own(runner, "_init_minimal_kv_cache_for_profiling")
    return [*allocation, (runner, "_init_minimal_kv_cache_for_profiling", _wrap_profiling(profiling)),
            *(_v2_seams(caps) if caps.model_runner_v2 else [])]


def _v2_seams(caps: Capabilities) -> list[Seam]:
    """Model Runner V2's allocation names. 0.26-0.28: its module functions that allocate and
    reshape KV tensors (it measures no CUDA-graph memory on a minimal KV cache there:
    ``profile_cudagraph_memory`` returns 0). 0.29+: the ``allocate_kv_cache`` its
    ``init_kv_cache`` imported (the same wrapper as V1's name), and the profiling mark on
    ``cudagraph_utils._init_minimal_kv_cache_for_profiling`` (``v2_profiling_cache``)."""
    from vllm.v1.worker.gpu import attn_utils

    if not caps.allocate_kv_cache:
        return [
            (attn_utils, "_allocate_kv_cache", _wrap_allocate_v2(require_own(attn_utils, "_allocate_kv_cache"))),
            (attn_utils, "_reshape_kv_cache", wrap_reshape_v2(require_own(attn_utils, "_reshape_kv_cache"))),
        ]
    from vllm.v1.worker import utils

    plan: list[Seam] = [(attn_utils, "allocate_kv_cache",
                         _wrap_allocate_views(require_vllm_helper(attn_utils, "allocate_kv_cache", utils)))]
    if caps.v2_profiling_cache:
        from vllm.v1.worker.gpu import cudagraph_utils

        name = "_init_minimal_kv_cache_for_profiling"
        plan.append((cudagraph_utils, name, _wrap_profiling(require_own(cudagraph_utils, name))))
    return plan
