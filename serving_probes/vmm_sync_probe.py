"""Does a CUDA VMM call wait for the device? A probe for the serving gap on the GPU (issue 30).

kvcached maps and unmaps pages between engine steps while vLLM's async scheduling keeps the next
step running on the device. If a driver call (``cuMemUnmap``, ``cuMemMap``, ``cuMemSetAccess``,
``cuMemCreate``, ``cuMemRelease``) waits for the device's outstanding work, each one costs the
host a whole device step and the overlap of scheduling with execution is gone.

The probe needs only torch and the driver (ctypes on ``libcuda.so.1``, no kvcached build): it
keeps the device busy with ``torch.cuda._sleep`` (one spinning kernel, ~``--busy-ms``), then
times each call on the host, on a page the kernel never touches, and asks whether the kernel
was still running when the call returned (``stream.query()``). The same call with the device
idle is the baseline. A call that waits shows ``busy_ms`` near the kernel's length and
``kernel_running_after`` false.

    python3 -m serving_probes.vmm_sync_probe --out /tmp/gpu-out/vmm-sync.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

MiB = 1 << 20


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


PINNED, ON_DEVICE, READ_WRITE = 1, 1, 3


class Driver:
    """The few driver calls the probe makes; a non-zero result raises, naming the call."""

    def __init__(self, device: int) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.prop = _AllocProp(type=PINNED, location=_Location(ON_DEVICE, device))
        self.access = _AccessDesc(location=_Location(ON_DEVICE, device), flags=READ_WRITE)
        gran = ctypes.c_size_t()
        self.call("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(self.prop), 0)
        self.page = gran.value
        self.ctx = ctypes.c_void_p()
        self.call("cuCtxGetCurrent", ctypes.byref(self.ctx))

    def on_thread(self, what: str, va: int, handle: int) -> None:
        """``what`` (none, map, unmap) on a thread of its own, in this thread's context."""
        self.call("cuCtxSetCurrent", self.ctx)
        if what == "map":
            self.map(va, handle)
            self.set_access(va)
        elif what == "unmap":
            self.unmap(va)

    def call(self, name: str, *args: object) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} returned CUresult {rc}")

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        self.call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                  ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        return ptr.value

    def create(self) -> int:
        handle = ctypes.c_uint64()
        self.call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(self.page), ctypes.byref(self.prop),
                  ctypes.c_ulonglong(0))
        return handle.value

    def map(self, va: int, handle: int) -> None:
        self.call("cuMemMap", ctypes.c_uint64(va), ctypes.c_size_t(self.page), ctypes.c_size_t(0),
                  ctypes.c_uint64(handle), ctypes.c_ulonglong(0))

    def set_access(self, va: int) -> None:
        self.call("cuMemSetAccess", ctypes.c_uint64(va), ctypes.c_size_t(self.page), ctypes.byref(self.access),
                  ctypes.c_size_t(1))

    def unmap(self, va: int) -> None:
        self.call("cuMemUnmap", ctypes.c_uint64(va), ctypes.c_size_t(self.page))

    def release(self, handle: int) -> None:
        self.call("cuMemRelease", ctypes.c_uint64(handle))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--busy-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    drv = Driver(torch.cuda.current_device())
    stream = torch.cuda.current_stream()
    cycles = calibrate(args.busy_ms)
    base = drv.reserve(64 * drv.page)
    slots = iter(range(64))

    def fresh_va() -> int:
        return base + next(slots) * drv.page

    rows = []
    for name in ("create", "map", "set_access", "unmap", "release"):
        for busy in (False, True):
            times, running_after = [], []
            for _ in range(args.repeats):
                va, handle = fresh_va(), drv.create()
                if name in ("set_access", "unmap"):
                    drv.map(va, handle)
                if name == "unmap":
                    drv.set_access(va)
                torch.cuda.synchronize()
                if busy:
                    torch.cuda._sleep(cycles)
                t0 = time.perf_counter()
                made = None
                if name == "create":
                    made = drv.create()
                elif name == "map":
                    drv.map(va, handle)
                elif name == "set_access":
                    drv.set_access(va)
                elif name == "unmap":
                    drv.unmap(va)
                else:
                    drv.release(handle)
                took = time.perf_counter() - t0
                running_after.append(busy and not stream.query())
                torch.cuda.synchronize()
                # Put things back: nothing stays mapped or allocated past its row.
                if made is not None:
                    drv.release(made)
                if name in ("map", "set_access"):
                    drv.unmap(va)
                if name != "release":
                    drv.release(handle)
                times.append(took * 1e3)
            rows.append({"call": name, "device": "busy" if busy else "idle",
                         "host_ms_median": statistics.median(times), "host_ms_max": max(times),
                         "kernel_running_after": sum(running_after), "repeats": args.repeats})
            slots = iter(range(64))
    rows += launch_beside(drv, fresh_va, cycles, args.repeats)
    drv.call("cuMemAddressFree", ctypes.c_uint64(base), ctypes.c_size_t(64 * drv.page))
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "page_bytes": drv.page,
           "busy_ms": args.busy_ms, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    for r in rows:
        print(f"{r['call']:>10} {r['device']:>4}: {r['host_ms_median']:8.3f} ms (max {r['host_ms_max']:.3f}), "
              f"kernel still running after {r['kernel_running_after']}/{r['repeats']}")
    return 0


def launch_beside(drv: Driver, fresh_va, cycles: int, repeats: int) -> list[dict[str, object]]:
    """With the device busy, a map or an unmap on another thread (as kvcached's background
    refill runs them): how long does this thread's next kernel launch take on the host?"""
    import threading

    import torch

    rows = []
    for name in ("none", "map", "unmap"):
        times = []
        for _ in range(repeats):
            va, handle = fresh_va(), drv.create()
            if name == "unmap":
                drv.map(va, handle)
                drv.set_access(va)
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            other = threading.Thread(target=drv.on_thread, args=(name, va, handle))
            other.start()
            time.sleep(0.001)  # time for the other thread to enter its call (not waited on)
            t0 = time.perf_counter()
            torch.cuda._sleep(1)
            times.append((time.perf_counter() - t0) * 1e3)
            other.join()
            torch.cuda.synchronize()
            if name == "map":
                drv.unmap(va)
            drv.release(handle)
        rows.append({"call": f"launch beside {name}", "device": "busy", "host_ms_median": statistics.median(times),
                     "host_ms_max": max(times), "kernel_running_after": None, "repeats": repeats})
    return rows


def calibrate(busy_ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the device busy about ``busy_ms``."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * busy_ms / start.elapsed_time(end))


if __name__ == "__main__":
    raise SystemExit(main())
