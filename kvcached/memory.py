"""Thin Python helpers over the native ``kvcached._vmm`` module.

The native layer hands out raw bytes as DLPack capsules; this module turns them into torch
tensors (`tensor_view`) or, without torch, numpy arrays of CPU ranges (`array_view`). torch
and numpy are imported inside the functions so that importing kvcached stays cheap and works
without either installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcached.errors import ConfigError

if TYPE_CHECKING:
    import numpy
    import torch

    from kvcached._vmm import VirtualRange

__all__ = ["array_view", "default_device_string", "tensor_view"]


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


class _Exporter:
    """What ``numpy.from_dlpack`` consumes: an object with ``__dlpack__``/``__dlpack_device__``.

    It hands out a DLPack 1.0 capsule, whose flags say writable (numpy makes arrays from the
    older, unversioned capsule read-only), when the consumer asks for version 1 or later.
    """

    def __init__(self, vrange: VirtualRange, offset: int, nbytes: int) -> None:
        self._args = (vrange, offset, nbytes)

    def __dlpack__(self, *, stream: None = None, max_version: tuple[int, int] | None = None,
                   dl_device: object = None, copy: bool | None = None) -> Any:
        if copy:
            raise BufferError("a kvcached view is never a copy")
        vrange, offset, nbytes = self._args
        return vrange.dlpack(offset, nbytes, versioned=max_version is not None and max_version[0] >= 1)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


def array_view(vrange: VirtualRange, offset: int = 0, nbytes: int = -1) -> numpy.ndarray:
    """A zero-copy, writable 1-D ``uint8`` numpy array over bytes of a CPU ``vrange`` (as
    `tensor_view`, through numpy's DLPack: for Pythons and tools without torch)."""
    import numpy as np

    if vrange.device != "cpu":
        raise ConfigError(f"array_view: numpy reads host memory only; this range is on {vrange.device}")
    return np.from_dlpack(_Exporter(vrange, offset, nbytes))


def default_device_string() -> str:
    """``"cuda:0"`` when the CUDA driver and a device are usable, else ``"cpu"``."""
    from kvcached import _vmm

    return "cuda:0" if _vmm.cuda_available() else "cpu"
