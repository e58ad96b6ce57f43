"""Per-page map/unmap cost of kvcached against the raw CUDA driver floor, in one run.

Floor: the driver calls a VMM map needs and nothing else, called through ctypes:
``cuMemCreate + cuMemMap + cuMemSetAccess`` to map and ``cuMemUnmap + cuMemRelease`` to
unmap one page. ctypes adds its own call overhead, measured separately with a trivial
driver call (``cuCtxGetCurrent``) and reported, so the floor is not flattered.

kvcached, same page size, same device:
* ``VirtualRange.map([i])`` / ``unmap([i])``: one page per call (the full native path);
* batched: 64 pages per ``map``/``unmap`` call;
* through the `PagePool` with a pre-mapped reserve: ``acquire``/``release`` of a page that
  is already mapped (what the scheduler pays when the reserve hides the driver).
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvcached import _vmm
from kvcached.config import KvcachedConfig
from kvcached.fence import StepFence
from kvcached.pages import PagePool, PageSpace


@dataclass(frozen=True)
class CostRow:
    path: str
    map_us: float
    unmap_us: float

    @property
    def total_us(self) -> float:
        return self.map_us + self.unmap_us


class _Driver:
    """The handful of driver entry points the floor needs, through ctypes."""

    class Prop(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                    ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                    ("win32HandleMetaData", ctypes.c_void_p),
                    ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                    ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]

    class Access(ctypes.Structure):
        _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]

    def __init__(self, device: int) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.device = device
        self.prop = self.Prop(type=1, loc_type=1, loc_id=device)
        self.access = self.Access(loc_type=1, loc_id=device, flags=3)

    def call(self, name: str, *args: object) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")


def _time(fn: Callable[[], None], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000.0


def raw_floor(device: int, page_size: int, pages: int) -> tuple[CostRow, float]:
    drv = _Driver(device)
    va = ctypes.c_ulonglong()
    drv.call("cuMemAddressReserve", ctypes.byref(va), ctypes.c_size_t(pages * page_size),
             ctypes.c_size_t(0), ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
    handles = [ctypes.c_ulonglong() for _ in range(pages)]
    map_t = unmap_t = 0
    try:
        start = time.perf_counter_ns()
        for i, h in enumerate(handles):
            drv.call("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(page_size), ctypes.byref(drv.prop),
                     ctypes.c_ulonglong(0))
            addr = ctypes.c_ulonglong(va.value + i * page_size)
            drv.call("cuMemMap", addr, ctypes.c_size_t(page_size), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0))
            drv.call("cuMemSetAccess", addr, ctypes.c_size_t(page_size), ctypes.byref(drv.access),
                     ctypes.c_size_t(1))
        map_t = time.perf_counter_ns() - start
        start = time.perf_counter_ns()
        for i, h in enumerate(handles):
            drv.call("cuMemUnmap", ctypes.c_ulonglong(va.value + i * page_size), ctypes.c_size_t(page_size))
            drv.call("cuMemRelease", h)
        unmap_t = time.perf_counter_ns() - start
    finally:
        drv.call("cuMemAddressFree", va, ctypes.c_size_t(pages * page_size))
    ctx = ctypes.c_void_p()
    overhead = _time(lambda: drv.call("cuCtxGetCurrent", ctypes.byref(ctx)), 2000)
    return CostRow("raw driver (ctypes)", map_t / pages / 1000, unmap_t / pages / 1000), overhead


def kvcached_rows(device: str, page_size: int, pages: int) -> list[CostRow]:
    rows = []
    vr = _vmm.VirtualRange(device, pages * page_size, page_size)
    try:
        start = time.perf_counter_ns()
        for i in range(pages):
            vr.map([i])
        map_t = time.perf_counter_ns() - start
        start = time.perf_counter_ns()
        for i in range(pages):
            vr.unmap([i])
        rows.append(CostRow("kvcached VirtualRange, 1 page/call", map_t / pages / 1000,
                            (time.perf_counter_ns() - start) / pages / 1000))
        batch = 64
        start = time.perf_counter_ns()
        for lo in range(0, pages, batch):
            vr.map(list(range(lo, min(lo + batch, pages))))
        map_t = time.perf_counter_ns() - start
        start = time.perf_counter_ns()
        for lo in range(0, pages, batch):
            vr.unmap(list(range(lo, min(lo + batch, pages))))
        rows.append(CostRow(f"kvcached VirtualRange, {batch} pages/call", map_t / pages / 1000,
                            (time.perf_counter_ns() - start) / pages / 1000))
        config = KvcachedConfig(page_size=page_size, min_reserve_pages=8, max_reserve_pages=8)
        pool = PagePool(PageSpace((vr,), (1,), pages), config, fence=StepFence())
        pool.prefetch(list(range(8)))
        reps = 2000
        start = time.perf_counter_ns()
        for _ in range(reps):
            pool.acquire([0])
            pool.release([0])
        per = (time.perf_counter_ns() - start) / reps / 1000
        rows.append(CostRow("kvcached PagePool, page from the pre-mapped reserve", per / 2, per / 2))
        pool.close()
    finally:
        vr.close()
    return rows
