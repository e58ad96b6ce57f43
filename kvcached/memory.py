"""Thin Python helpers over the native ``kvcached._vmm`` module.

The native layer hands out raw bytes as DLPack capsules; this module turns them into torch
tensors. torch is imported inside the functions so that importing kvcached stays cheap and
works without torch installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcached.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvcached._vmm import VirtualRange

__all__ = ["default_device_string", "tensor_view"]


def tensor_view(
    vrange: VirtualRange,
    offset: int = 0,
    nbytes: int = -1,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Return a zero-copy 1-D tensor over ``nbytes`` bytes of ``vrange`` starting at ``offset``.

    ``nbytes=-1`` means "to the end of the range". With ``dtype`` the bytes are reinterpreted
    (``nbytes`` must then be a multiple of the element size). The tensor holds a reference to
    the reservation, so the address range stays reserved while the tensor lives, even after
    ``vrange.close()``; reading pages that are not mapped faults, exactly like on a GPU.
    """
    import torch

    view = torch.from_dlpack(vrange.dlpack(offset, nbytes))
    if dtype is None or dtype == torch.uint8:
        return view
    itemsize = torch.empty((), dtype=dtype).element_size()
    if view.numel() % itemsize != 0 or offset % itemsize != 0:
        raise ConfigError(
            f"tensor_view: offset {offset} and length {view.numel()} must be multiples of "
            f"the {dtype} element size {itemsize}"
        )
    return view.view(dtype)


def default_device_string() -> str:
    """``"cuda:0"`` when the CUDA driver and a device are usable, else ``"cpu"``."""
    from kvcached import _vmm

    return "cuda:0" if _vmm.cuda_available() else "cpu"
