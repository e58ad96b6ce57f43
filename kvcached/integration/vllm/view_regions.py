"""Regions of vLLM 0.29's one KV buffer: which views overlap, and how to rebuild them.

vLLM 0.29 places every KV view in one int8 buffer (``allocate_kv_cache``). kvcached runs
vLLM's function on the ``meta`` device to learn each view's geometry, then backs each
*region* (a maximal byte range of overlapping views, all with one logical block stride)
with a virtual range of its own and rebuilds the views over it. Pure tensor geometry: no
vLLM import, no memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcached.errors import IntegrationError

__all__ = ["Region", "plan_regions", "rebase"]


@dataclass
class Region:
    """Bytes ``[start, end)`` of vLLM's buffer covered by overlapping views; one backing."""

    start: int
    end: int
    stride: int  # bytes per logical block, the same for every view of the region
    layers: list[str]


def _byte_span(view: torch.Tensor, num_blocks: int) -> tuple[int, int, int]:
    """``(first byte, end byte, logical block stride)`` of a view, in bytes of its buffer."""
    item = view.element_size()
    if view.numel() == 0 or any(st < 0 for st in view.stride()):
        raise IntegrationError(f"vLLM built a KV view of shape {tuple(view.shape)} kvcached cannot back")
    ratio, rest = divmod(int(view.shape[0]), num_blocks)
    if ratio == 0 or rest:
        raise IntegrationError(f"KV view of shape {tuple(view.shape)} has no {num_blocks}-block dimension 0")
    start = int(view.storage_offset()) * item
    end = start + item * (1 + sum((sz - 1) * st for sz, st in zip(view.shape, view.stride())))
    return start, end, int(view.stride(0)) * item * ratio


def plan_regions(views: dict[str, torch.Tensor], num_blocks: int) -> list[Region]:
    """Split vLLM's one buffer into regions of overlapping views, each a block-strided backing."""
    spans = sorted((*_byte_span(v, num_blocks), name) for name, v in views.items())
    regions: list[Region] = []
    for start, end, stride, name in spans:
        if regions and start < regions[-1].end:
            region = regions[-1]
            if stride != region.stride:
                raise IntegrationError(
                    f"KV views {region.layers[0]} and {name} overlap but disagree on the block stride "
                    f"({region.stride} vs {stride} bytes)"
                )
            region.end = max(region.end, end)
            region.layers.append(name)
        else:
            regions.append(Region(start, end, stride, [name]))
    for region in regions:
        if region.end - region.start > num_blocks * region.stride:
            raise IntegrationError(
                f"KV views {region.layers} span {region.end - region.start} bytes, more than {num_blocks} "
                f"blocks of {region.stride}: the layout does not keep each block in its own row"
            )
    return regions


def rebase(raw: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``raw`` (int8) at byte ``offset`` with ``like``'s shape, strides and dtype."""
    item = like.element_size()
    shape, stride = list(like.shape), [int(st) for st in like.stride()]
    if like.dtype != raw.dtype:
        if stride[-1] != 1 and shape[-1] != 1:
            raise IntegrationError(f"typed KV view with strides {tuple(stride)} has no contiguous last dimension")
        shape[-1] *= item
        stride = [st * item for st in stride[:-1]] + [1]
    view = torch.as_strided(raw, shape, stride, raw.storage_offset() + offset)
    if like.dtype != raw.dtype:
        view = view.view(like.dtype)
    if (view.shape, view.stride(), view.dtype) != (like.shape, like.stride(), like.dtype):
        raise IntegrationError(
            f"cannot rebuild KV view {tuple(like.shape)}/{like.stride()}/{like.dtype} over a kvcached range"
        )
    return view
