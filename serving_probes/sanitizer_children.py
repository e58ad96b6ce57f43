"""Small programs the sanitizer probe runs under ``compute-sanitizer`` as controls.

    python -m serving_probes.sanitizer_children torch-clean   # torch use, caches released
    python -m serving_probes.sanitizer_children torch-leak    # a device tensor still held at exit
    python -m serving_probes.sanitizer_children vmm-leak      # a cuMemCreate handle never released

``torch-clean`` must come out clean once torch's caches are released; ``torch-leak``
must still be reported (the release hides nothing that is really held); ``vmm-leak``
shows whether the leak check sees driver VMM handles at all, which decides what a clean
report says about kvcached's own physical pages.
"""

from __future__ import annotations

import ctypes
import sys

from serving_probes.torch_caches import release_torch_caches

_HELD: list[object] = []


def _torch_clean() -> None:
    import torch

    def use() -> float:
        x = torch.randn(1 << 20, device="cuda")
        return float(x.clone().sum())  # a host sync through torch's pinned staging

    for _ in range(3):
        use()
    release_torch_caches()


def _torch_leak() -> None:
    import torch

    _HELD.append(torch.ones(1 << 20, device="cuda"))
    release_torch_caches()


class _Prop(ctypes.Structure):
    """CUmemAllocationProp (32 bytes; enums are 4-byte ints)."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                ("win32HandleMetaData", ctypes.c_void_p),
                ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


def _vmm_leak() -> None:
    lib = ctypes.CDLL("libcuda.so.1")

    def call(name: str, *args: object) -> None:
        rc = getattr(lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")

    call("cuInit", ctypes.c_uint(0))
    ctx = ctypes.c_void_p()
    call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), ctypes.c_int(0))
    call("cuCtxSetCurrent", ctx)
    prop = _Prop(type=1, loc_type=1, loc_id=0)  # pinned, on device 0
    gran = ctypes.c_size_t()
    call("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), ctypes.c_int(0))
    handle = ctypes.c_ulonglong()
    call("cuMemCreate", ctypes.byref(handle), gran, ctypes.byref(prop), ctypes.c_ulonglong(0))
    _HELD.append(handle)  # never cuMemRelease'd


CHILDREN = {"torch-clean": _torch_clean, "torch-leak": _torch_leak, "vmm-leak": _vmm_leak}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CHILDREN:
        print(f"usage: python -m serving_probes.sanitizer_children {{{','.join(CHILDREN)}}}", file=sys.stderr)
        return 2
    CHILDREN[argv[0]]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
