"""Tenant isolation on a GPU: memory one process gave back reads as zeros to the next.

kvcached relies on the CUDA driver handing out zeroed memory from ``cuMemCreate``: a page one
engine unmapped and released must never show its bytes to another engine (or to another
request of the same engine, once the page is created again). This probe catches a driver
that stops doing so:

1. process A maps ``gib`` GiB of 2 MiB pages through a kvcached range, fills them with 0xAB
   (the control: a count of non-zero bytes then equals the bytes written), unmaps and
   releases them, maps as many again and counts non-zero bytes (same process);
2. process B, started after A exits, maps ``gib_b`` GiB (more than A had) and counts;
3. the cost kvcached would pay to zero a page on map if a driver did not (a ``memset`` of
   one page, timed on the device), for the record.

    python -m serving_probes --only isolation
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conformance.reporting import Bullets, Provenance, Section
from serving_probes.probe_report import write_probe_report

GiB = 1 << 30
PAGE = 2 << 20


def _count_nonzero(view: Any) -> int:
    import torch

    total = 0
    for chunk in view.split(1 << 32):  # 4 GiB at a time
        total += int(torch.count_nonzero(chunk))
    return total


def _tenant(device: str, gib: float, fill: bool, out: Any) -> None:
    """Map ``gib`` GiB; optionally fill, release and map again; report non-zero bytes."""
    import torch

    from kvcached import _vmm
    from kvcached.memory import tensor_view

    pages = int(gib * GiB) // PAGE
    vrange = _vmm.VirtualRange(device, pages * PAGE, PAGE)
    result: dict[str, float] = {"bytes": pages * PAGE}
    try:
        t0 = time.perf_counter()
        vrange.map(list(range(pages)))
        result["map_s"] = time.perf_counter() - t0
        view = tensor_view(vrange)
        result["nonzero_fresh"] = _count_nonzero(view)
        if fill:
            view.fill_(0xAB)
            torch.cuda.synchronize()
            result["nonzero_after_fill"] = _count_nonzero(view)  # the control
            del view
            vrange.unmap(list(range(pages)))
            vrange.map(list(range(pages)))
            view = tensor_view(vrange)
            result["nonzero_after_remap"] = _count_nonzero(view)
            one = view[:PAGE]
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(100):
                one.zero_()
            end.record()
            torch.cuda.synchronize()
            result["zero_one_page_us"] = start.elapsed_time(end) * 1000 / 100
        del view
        vrange.unmap(list(range(pages)))
    finally:
        vrange.close()
        out.put(result)


@dataclass
class IsolationProbe:
    device: str
    first: dict[str, float]
    second: dict[str, float]
    checks: dict[str, bool]


def _run_child(device: str, gib: float, fill: bool) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_tenant, args=(device, gib, fill, out), daemon=True)
    proc.start()
    result = out.get(timeout=600)
    proc.join(120)
    return result


def run(device: str = "cuda:0", gib: float = 64.0, gib_b: float = 100.0) -> IsolationProbe:
    first = _run_child(device, gib, fill=True)
    second = _run_child(device, gib_b, fill=False)
    checks = {
        "the control sees the bytes written": first["nonzero_after_fill"] == first["bytes"],
        "fresh pages read zero": first["nonzero_fresh"] == 0,
        "pages created again in the same process read zero": first["nonzero_after_remap"] == 0,
        "another process's pages read zero": second["nonzero_fresh"] == 0,
    }
    return IsolationProbe(device, first, second, checks)


def write_report(probe: IsolationProbe, out_dir: Path, environment: Provenance, save: bool = True) -> Path:
    a, b = probe.first, probe.second
    found = (
        (f"process A: {a['bytes'] / GiB:.0f} GiB mapped in {a['map_s']:.2f} s; non-zero bytes: fresh "
         f"{a['nonzero_fresh']:.0f}, after filling 0xAB {a['nonzero_after_fill']:.0f} (the control), after "
         f"release and map again {a['nonzero_after_remap']:.0f}"),
        f"process B (after A exited): {b['bytes'] / GiB:.0f} GiB mapped, non-zero bytes {b['nonzero_fresh']:.0f}",
        (f"zeroing one page on the device would cost {a['zero_one_page_us']:.1f} µs per 2 MiB page "
         "(not paid: the driver zeroes)"),
    )
    return write_probe_report(out_dir, "isolation", "Tenant isolation on the GPU: given-back memory reads as zeros",
                              environment, asdict(probe),
                              "`serving_probes/isolation.py` (its docstring); 2 MiB pages through kvcached ranges.",
                              [Section("Measured", (Bullets(found),))], probe.checks, save)


def render_saved(data: dict[str, object], environment: Provenance, out_dir: Path) -> Path:
    """The report of a saved run (``isolation.json``), rendered again."""
    return write_report(IsolationProbe(**data), out_dir, environment, save=False)  # type: ignore[arg-type]