"""Per-page cost of the CPU backend (map, touch every OS page, unmap) against a raw mmap floor.

The floor does the same work with nothing of kvcached in the way: an anonymous ``mmap`` of one
page, the same touches, and ``munmap``. Both sides touch memory through the same numpy code,
so the difference is what kvcached's reservation, memfd slot mapping, ``PROT_NONE`` re-mapping
and hole punching cost on top of the kernel's own page-fault and zeroing work.

    python benchmarks/bench_cpu_map.py [--pages 256] [--page-size-mib 2] [--repeat 7]

Prints microseconds per page and the ratio, and writes reports/bench/cpu_map.{md,json}.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from conformance.reporting import Paragraph, Report, Section, provenance, saved_environment, table, write_report
from kvcached import _vmm

ROOT = Path(__file__).resolve().parent.parent
OS_PAGE = mmap.PAGESIZE
OURS = "kvcached map+touch+unmap, one page per call"
FLOOR = "floor mmap+touch+munmap (plain anonymous)"
LOAD_NOTE = "page-fault costs move a lot with load on a shared machine; compare runs at similar load"


def touch(address: int, nbytes: int) -> None:
    """Write one byte in every OS page of [address, address + nbytes)."""
    buf = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
    buf[::OS_PAGE] = 1


def kvcached_per_page(vrange: _vmm.VirtualRange, touched: bool = True) -> float:
    """Seconds per page for map([p]) + touch + unmap([p]), one page at a time."""
    ps = vrange.page_size
    t0 = time.perf_counter()
    for p in range(vrange.num_pages):
        vrange.map([p])
        if touched:
            touch(vrange.address + p * ps, ps)
        vrange.unmap([p])
    return (time.perf_counter() - t0) / vrange.num_pages


def kvcached_batched(vrange: _vmm.VirtualRange) -> float:
    """Seconds per page when all pages are mapped, touched and unmapped in single batches."""
    n = vrange.num_pages
    t0 = time.perf_counter()
    vrange.map(range(n))
    touch(vrange.address, vrange.size)
    vrange.unmap(range(n))
    return (time.perf_counter() - t0) / n


def floor_per_page(page_size: int, pages: int, touched: bool = True, huge: bool = False) -> float:
    """Seconds per page for anonymous mmap + touch + munmap of one page.

    Plain by default (whatever the system's THP mode gives an un-advised mapping);
    ``huge`` asks for a transparent huge page with MADV_HUGEPAGE.
    """
    t0 = time.perf_counter()
    for _ in range(pages):
        mm = mmap.mmap(-1, page_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            mm.madvise(mmap.MADV_HUGEPAGE)
        if touched:
            arr = np.frombuffer(mm, dtype=np.uint8)
            arr[::OS_PAGE] = 1
            del arr  # drop the buffer export so the mapping can be closed
        mm.close()
    return (time.perf_counter() - t0) / pages


def measure(cases: dict[str, Callable[[], float]], repeat: int) -> tuple[dict[str, float], float]:
    """Median us/page per case, and the median of the paired first/second-case ratios.

    Cases run interleaved inside each repetition, so drift from other load on the machine hits
    all of them alike; one warm-up round (first faults, allocator and import effects) is dropped.
    """
    from conformance.progress import RunProgress

    for fn in cases.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    with RunProgress(repeat * len(cases), "bench cpu map") as progress:
        for r in range(repeat):
            for name, fn in cases.items():
                samples[name].append(fn() * 1e6)
                progress.advance(f"round {r + 1}: {name}")
    ours, floor = (samples[name] for name in list(cases)[:2])
    ratio = statistics.median(a / b for a, b in zip(ours, floor))
    return {name: statistics.median(v) for name, v in samples.items()}, ratio


def _thp() -> str:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return thp.read_text().strip() if thp.exists() else "n/a"


NOTE = ("Touch = one byte written in every 4 KiB of the page, identical numpy code for both sides. The plain floor "
        "is an un-advised anonymous mapping (4 KiB pages unless the THP mode is `always`); kvcached's memfd slots "
        "are 4 KiB shmem pages. The MADV_HUGEPAGE floor shows what one 2 MiB fault per page would cost instead.")


def build(saved: dict[str, Any]) -> Report:
    """The report as data, from the saved run (``cpu_map.json``)."""
    load = saved["load_average_1min"]
    run = (f"Pages: {saved['pages']} x {saved['page_size_bytes'] >> 20} MiB, median of {saved['repeat']} interleaved "
           f"runs after one warm-up. 1-minute load average before/after: {load[0]:.2f} / {load[1]:.2f} ({LOAD_NOTE}).")
    rows = [{"what": name, "us / page": f"{us:.1f}"} for name, us in saved["us_per_page"].items()]
    rows.append({"what": "ratio (kvcached one page per call / plain floor, median of paired runs)",
                 "us / page": f"{saved['ratio']:.2f}x"})
    return Report(subject="CPU backend: map + touch + unmap cost per page",
                  headline=f"kvcached one page per call / plain floor: **{saved['ratio']:.2f}x** (median of paired runs).",
                  environment=saved_environment(saved),
                  body=(Section("Method", (Paragraph(run), Paragraph(NOTE))), Section("Cost per page", (table(rows),))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-size-mib", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "bench")
    ap.add_argument("--render", action="store_true", help="render the report again from cpu_map.json in --out")
    args = ap.parse_args(argv)
    if args.render:
        print(write_report(build(json.loads((args.out / "cpu_map.json").read_text())), args.out, "cpu_map"))
        return 0
    ps = args.page_size_mib << 20
    command = ["python", os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])]
    environment = provenance(command, {"numpy": np.__version__, "thp": _thp()})

    vrange = _vmm.VirtualRange("cpu", args.pages * ps, ps)
    n = args.pages
    cases: dict[str, Callable[[], float]] = {
        OURS: lambda: kvcached_per_page(vrange),
        FLOOR: lambda: floor_per_page(ps, n),
        "kvcached map+touch+unmap, one batch": lambda: kvcached_batched(vrange),
        "floor mmap+touch+munmap, MADV_HUGEPAGE": lambda: floor_per_page(ps, n, huge=True),
        "kvcached map+unmap, no touch": lambda: kvcached_per_page(vrange, touched=False),
        "floor mmap+munmap, no touch": lambda: floor_per_page(ps, n, touched=False),
    }
    load_before = os.getloadavg()[0]
    rows, ratio = measure(cases, args.repeat)
    load_after = os.getloadavg()[0]
    vrange.close()
    saved = {"environment": environment.as_dict(), "pages": args.pages, "page_size_bytes": ps, "repeat": args.repeat,
             "load_average_1min": [round(load_before, 2), round(load_after, 2)], "us_per_page": rows, "ratio": ratio}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_map.json").write_text(json.dumps(saved, indent=2) + "\n")
    print(write_report(build(saved), args.out, "cpu_map").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
