"""Per-page map/unmap cost of kvcached against the raw CUDA driver floor, in one run.

Both sides are timed in alternating rounds in one process (`measure`).

Floor: the driver calls a VMM map needs and nothing else, timed natively in C++
(`kvcached._vmm.cuda_driver_floor`): ``cuMemCreate + cuMemMap + cuMemSetAccess`` to map
and ``cuMemUnmap + cuMemRelease`` to unmap one page, with no bookkeeping and no Python
between the calls. Its per-call means are also reported next to the spec's reference
figures for this H200.

kvcached, same page size, same device, called from Python as the scheduler does:
* ``VirtualRange.map([i])`` / ``unmap([i])``: one page per call (the full native path);
* batched: 64 pages per ``map``/``unmap`` call;
* through the `PagePool` with a pre-mapped reserve: ``acquire``/``release`` of a page that
  is already mapped (what the scheduler pays when the reserve hides the driver).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from kvcached import _vmm
from kvcached.config import KvcachedConfig
from kvcached.fence import StepFence
from kvcached.pages import PagePool, PageSpace

#: The spec's measured driver cost of one 2 MiB page on the H200, µs per call.
SPEC_REFERENCE_US = {"create_us": 11.0, "map_us": 2.0, "set_access_us": 27.0, "unmap_us": None,
                     "release_us": None, "unmap+release_us": 31.0}


@dataclass(frozen=True)
class CostRow:
    path: str
    map_us: float
    unmap_us: float

    @property
    def total_us(self) -> float:
        return self.map_us + self.unmap_us


def _floor_calls(device: int, page_size: int, pages: int) -> dict[str, float]:
    calls = dict(_vmm.cuda_driver_floor(device, page_size, pages))
    calls["unmap+release_us"] = calls["unmap_us"] + calls["release_us"]
    return calls


def _floor_row(calls: dict[str, float]) -> CostRow:
    return CostRow("raw driver calls (C++ timing)", calls["create_us"] + calls["map_us"] + calls["set_access_us"],
                   calls["unmap+release_us"])


@dataclass(frozen=True)
class CostResult:
    rows: list[CostRow]  # floor first; medians over the timed rounds
    floor_calls: list[dict[str, object]]  # per driver call, beside the spec's figures
    ratio_range: dict[str, tuple[float, float]]  # path -> (min, max) per-round ratio to that round's floor


def measure(device: str, page_size: int, pages: int, rounds: int = 5) -> CostResult:
    """Floor and kvcached paths alternated for ``rounds`` rounds after one warm-up round.

    Alternating in one process gives both sides the same driver state (the first pass
    through the VMM API is slower); each figure is the median over the timed rounds.
    """
    ordinal = int(device.split(":")[1]) if ":" in device else 0
    per_round: list[tuple[dict[str, float], list[CostRow]]] = []
    for _ in range(rounds + 1):
        per_round.append((_floor_calls(ordinal, page_size, pages), kvcached_rows(device, page_size, pages)))
    timed = per_round[1:]
    calls = {k: statistics.median(c[k] for c, _ in timed) for k in timed[0][0]}
    floor = _floor_row(calls)
    rows = [floor]
    ratio_range = {}
    for i, first in enumerate(timed[0][1]):
        samples = [r[i] for _, r in timed]
        rows.append(CostRow(first.path, statistics.median(r.map_us for r in samples),
                            statistics.median(r.unmap_us for r in samples)))
        ratios = [r[i].total_us / _floor_row(c).total_us for c, r in timed]
        ratio_range[first.path] = (round(min(ratios), 3), round(max(ratios), 3))
    breakdown: list[dict[str, object]] = [{"driver call": key.removesuffix("_us").replace("_", " "),
                  "measured_us": round(value, 2), "spec_reference_us": SPEC_REFERENCE_US[key]}
                 for key, value in calls.items()]
    return CostResult(rows, breakdown, ratio_range)


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
