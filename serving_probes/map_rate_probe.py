"""How fast does kvcached map kv pages while the engine's threads compete? A probe for the
scheduler's map cost on the GPU (issue 30).

A serving run (reports/gpu/serving/run-12-06b) shows kvcached mapping kv pages on the
scheduler's path at ~3-7 ms per kv page (16 VMM pages of 2 MiB, one in each of 16 ranges of
1 GiB), against a raw driver floor of ~0.73 ms (16 x ~45 µs create + map + set-access).
Meanwhile the refill thread (``kvcached-refill``) maps other pages in the same process, and the
main thread is busy in Python (vLLM's scheduler) and launching GPU work. Candidate causes:

1. GIL round trips: every `VirtualRange.map` releases and retakes the GIL, and a thread that
   retakes it from a thread busy in pure Python waits up to ``sys.getswitchinterval()`` (5 ms);
2. two threads' driver calls serializing in the driver;
3. driver calls slower while the device runs heavy kernels;
4. per-call Python overhead in `PageSpace` (one C call per kv page per range).

The probe builds the engine's own objects (`kvcached.space.plan_geometry`, one
`kvcached._vmm.VirtualRange` per backing, the `PageSpace` of a `KvSpace`), with the engine's
geometry by default, and times the map and the unmap of a batch of kv pages (per kv page, µs)
under five conditions:

a. the main thread alone, the device idle;
b. the main thread while another thread spins pure Python (the scheduler, GIL-hungry);
c. a background thread mapping (as the refill thread does) while the main thread spins pure
   Python: the background thread's time (the GIL convoy);
d. the main thread while a second thread maps and unmaps other kv pages (driver serialization);
e. the main thread while the device runs large bf16 matmuls on a side stream, on memory the
   probe never maps or unmaps (CUDA only).

In a, b and c each batch is timed two ways: through `PageSpace.map_pages` / `unmap_pages`
(the engine's path: one ``map`` call per kv page per range; its unmap asks ``is_mapped`` of
every VMM page, then makes one ``unmap`` call per range), and with one `VirtualRange.map` /
``unmap`` call per range for the whole batch. On CUDA the raw driver floor
(`kvcached._vmm.cuda_driver_floor`, timed in C++) is measured beside them.

The JSON keeps every sample; the report renders again from it, with no GPU::

    python3 -m serving_probes.map_rate_probe --device cuda --out /tmp/gpu-out/map-rate.json
    python3 -m serving_probes.map_rate_probe --render --out reports/gpu/map-rate/map-rate.json

On the CPU backend (``--device cpu``, memfd) it runs too, with small sizes (a smoke test).
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conformance.reporting import Bullets, Paragraph, Provenance, Section, provenance, table
from kvcached.config import parse_bytes
from kvcached.errors import ConfigError

if TYPE_CHECKING:
    from typing_extensions import Self

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
NAME = "map-rate"  # the saved JSON's stem in serving_probes.probe_report

CONDITIONS = {
    "a": "main thread alone, device idle",
    "b": "main thread, another thread spinning pure Python",
    "c": "background thread mapping, the main thread spinning pure Python",
    "d": "main thread, a second thread mapping and unmapping other kv pages",
    "e": "main thread, the device running bf16 matmuls on a side stream",
}
#: The conditions timed both ways (``MODES``); d and e time the engine's path only.
BOTH_MODES = ("a", "b", "c")
PAGESPACE, PER_RANGE = "pagespace", "per-range"
MODES = {PAGESPACE: "PageSpace (engine's path)", PER_RANGE: "one call per range"}
JOIN_S = 120.0  # the most a helper thread is waited for once told to stop


class ProbeArgumentError(ConfigError):
    """A probe setting out of range (the CLI turns it into a usage error, exit status 2)."""


@dataclass(frozen=True)
class Settings:
    """The probe's geometry and effort. Invariant (after `check`): the ranges hold two
    batches of kv pages (the main thread's and the second thread's)."""

    device: str = "cuda"
    ranges: int = 16
    range_bytes: int = GiB
    page_bytes: int = 2 * MiB
    vmm_pages_per_kv_page: int = 1
    batch: int = 8  # kv pages per timed map (and unmap)
    repeats: int = 7
    matmul: int = 8192  # side-stream bf16 matmul size (e)
    gpu_busy_ms: float = 60.0  # device work queued before each repeat of e
    switch_interval_ms: float | None = None  # sys.setswitchinterval for the run; None: Python's own

    @property
    def kv_page_bytes(self) -> int:
        return self.ranges * self.vmm_pages_per_kv_page * self.page_bytes

    @property
    def kv_pages(self) -> int:
        return self.range_bytes // (self.vmm_pages_per_kv_page * self.page_bytes)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def ordinal(self) -> int:
        return int(self.device.split(":", 1)[1]) if ":" in self.device else 0

    def check(self) -> None:
        """`ProbeArgumentError` naming the first setting out of range."""
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ProbeArgumentError(f"--device {self.device!r}: expected cpu, cuda or cuda:N")
        for name in ("ranges", "range_bytes", "page_bytes", "vmm_pages_per_kv_page", "batch", "repeats", "matmul"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ProbeArgumentError(f"--{name.replace('_', '-')} {value!r}: must be a positive integer")
        if not self.gpu_busy_ms > 0:
            raise ProbeArgumentError(f"--gpu-busy-ms {self.gpu_busy_ms}: must be > 0")
        if self.switch_interval_ms is not None and not self.switch_interval_ms > 0:
            raise ProbeArgumentError(f"--switch-interval-ms {self.switch_interval_ms}: must be > 0")
        if self.range_bytes % self.page_bytes:
            raise ProbeArgumentError(f"--range-bytes {self.range_bytes} is not a multiple of --page-bytes "
                                     f"{self.page_bytes}")
        if self.kv_pages < 2 * self.batch:
            raise ProbeArgumentError(
                f"a range of {self.range_bytes} bytes holds {self.kv_pages} kv pages of {self.vmm_pages_per_kv_page} "
                f"VMM page(s) of {self.page_bytes} bytes; the probe needs 2 x --batch = {2 * self.batch}")


@dataclass
class Row:
    """One condition timed one way: µs per kv page, one sample per repeat."""

    condition: str
    mode: str
    thread: str  # whose map and unmap calls were timed: main, background
    map_calls: int  # VirtualRange.map calls per batch
    unmap_calls: int  # VirtualRange.unmap calls per batch
    map_us: list[float]
    unmap_us: list[float]
    busy_before_map: list[bool] | None = None  # e: the side stream ran when the map began (the method holds)
    busy_after_map: list[bool] | None = None  # e: the side stream still ran when the map returned
    busy_after_unmap: list[bool] | None = None
    beside_map_us: list[float] | None = None  # d: the second thread's µs per kv page, each batch
    beside_unmap_us: list[float] | None = None
    spinner_loops: int | None = None  # b, c: the spinning thread's loops (it did spin)


@dataclass
class Result:
    settings: Settings
    rows: list[Row] = field(default_factory=list)
    floor_us: dict[str, float] | None = None  # raw driver µs per call (CUDA), per VMM page
    skipped: dict[str, str] = field(default_factory=dict)  # condition -> why not run
    errors: dict[str, str] = field(default_factory=dict)  # condition -> what it raised
    left_mapped: dict[str, int] = field(default_factory=dict)  # condition -> VMM pages mapped after it
    teardown_left_mapped: int = 0
    switch_interval_s: float = 0.0
    device_name: str = ""
    matmul_ms: float | None = None  # e: one side-stream matmul, timed on the device
    seconds: float = 0.0


# ---- the things that run beside ------------------------------------------------------------------


class Spinner:
    """A thread spinning pure Python until stopped: it gives the GIL up only when forced."""

    def __init__(self) -> None:
        self.stop = False
        self.loops = 0
        self._running = threading.Event()
        self._thread = threading.Thread(target=self._spin, name="map-rate-spinner", daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self.stop:
            n += 1
            if n == 1:  # spinning, not merely started: the OS may not run it again before a short timing ends
                self._running.set()
        self.loops = n

    def __enter__(self) -> Self:
        self._thread.start()
        self._running.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        self._thread.join(JOIN_S)
        if self._thread.is_alive():
            raise RuntimeError(f"the spinning thread did not stop within {JOIN_S:.0f} s")


class Mapper:
    """A second thread mapping and unmapping ``pages`` through the space until stopped,
    timing each batch (µs per kv page) once its first batch is done."""

    def __init__(self, space: Any, pages: list[int]) -> None:
        self.space, self.pages = space, pages
        self.stop = False
        self.map_us: list[float] = []
        self.unmap_us: list[float] = []
        self.error: BaseException | None = None
        self._warm = threading.Event()
        self._thread = threading.Thread(target=self._run, name="map-rate-mapper", daemon=True)

    def _run(self) -> None:
        try:
            first = True
            while not self.stop:
                t0 = time.perf_counter_ns()
                self.space.map_pages(self.pages)
                t1 = time.perf_counter_ns()
                self.space.unmap_pages(self.pages)
                t2 = time.perf_counter_ns()
                if not first:
                    self.map_us.append((t1 - t0) / len(self.pages) / 1e3)
                    self.unmap_us.append((t2 - t1) / len(self.pages) / 1e3)
                first = False
                self._warm.set()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            self.error = exc
        finally:
            self._warm.set()

    def __enter__(self) -> Self:
        self._thread.start()
        self._warm.wait(JOIN_S)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        self._thread.join(JOIN_S)
        if self._thread.is_alive():
            raise RuntimeError(f"the second mapping thread did not stop within {JOIN_S:.0f} s")
        if self.error is not None:
            raise self.error


class GpuLoad:
    """Large bf16 matmuls queued on a side stream, on memory of torch's own (never mapped or
    unmapped by the probe)."""

    def __init__(self, ordinal: int, n: int) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cuda", ordinal)
        self.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.stream):
            self.a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
            self.b = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
            self.c = torch.empty(n, n, device=self.device, dtype=torch.bfloat16)
            for _ in range(3):  # the kernel chosen and loaded
                torch.mm(self.a, self.b, out=self.c)
        self.stream.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            for _ in range(5):
                torch.mm(self.a, self.b, out=self.c)
            end.record()
        end.synchronize()
        self.ms = start.elapsed_time(end) / 5

    def queue(self, ms: float) -> None:
        """Queue about ``ms`` of matmuls (returns at once; at most 1,000, within the launch queue)."""
        with self.torch.cuda.stream(self.stream):
            for _ in range(min(1000, max(1, round(ms / self.ms)))):
                self.torch.mm(self.a, self.b, out=self.c)

    def busy(self) -> bool:
        return not self.stream.query()

    def drain(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.drain()
        del self.a, self.b, self.c


# ---- timing ---------------------------------------------------------------------------------------


@dataclass
class Rig:
    """The engine's objects over the probe's ranges: `close` unmaps what is mapped and closes them."""

    space: Any  # kvcached.pages.PageSpace
    ranges: tuple[Any, ...]  # kvcached._vmm.VirtualRange

    @classmethod
    def open(cls, s: Settings) -> Rig:
        from kvcached import _vmm
        from kvcached.pages import PageSpace
        from kvcached.space import KvSpace, plan_geometry

        # A block stride of whole kv pages: one block per kv page, vmm_pages_per_kv_page VMM pages per range.
        geometry = plan_geometry([s.vmm_pages_per_kv_page * s.page_bytes] * s.ranges, s.kv_pages, s.page_bytes)
        ranges: list[Any] = []
        try:
            for size in geometry.reserved_bytes:
                ranges.append(_vmm.VirtualRange(s.device, size, s.page_bytes))
            space = KvSpace(geometry, tuple(ranges)).page_space()
            if not isinstance(space, PageSpace):
                raise TypeError(f"a KvSpace over local ranges gave {type(space).__name__}, not a PageSpace")
        except BaseException:
            for r in ranges:
                r.close()
            raise
        return cls(space, tuple(ranges))

    def mapped(self) -> int:
        return sum(r.num_mapped for r in self.ranges)

    def unmap_all(self) -> None:
        """Unmap whatever is mapped, every range tried; the first error raised after."""
        first: BaseException | None = None
        for r in self.ranges:
            try:
                if r.num_mapped:
                    r.unmap(r.mapped_pages())
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the other ranges
                first = first or exc
        if first is not None:
            raise first

    def close(self) -> None:
        try:
            self.unmap_all()
        finally:
            for r in self.ranges:
                r.close()

    def ops(self, pages: list[int], mode: str) -> tuple[Callable[[], None], Callable[[], None], int, int]:
        """Map and unmap of ``pages`` the ``mode`` way, and their VirtualRange call counts."""
        space = self.space
        if mode == PAGESPACE:
            # A map per range for the whole batch (c6dc208), all inside one native call (map_each).
            return (lambda: space.map_pages(pages), lambda: space.unmap_pages(pages),
                    len(self.ranges), len(self.ranges))
        lists = [[v for p in pages for v in space.vmm_pages(r, p)] for r in range(len(self.ranges))]
        pairs = list(zip(self.ranges, lists, strict=True))

        def map_() -> None:
            for vrange, vmm in pairs:
                vrange.map(vmm)

        def unmap() -> None:
            for vrange, vmm in pairs:
                vrange.unmap(vmm)

        return map_, unmap, len(self.ranges), len(self.ranges)


def time_batches(rig: Rig, pages: list[int], mode: str, repeats: int, condition: str, thread: str,
                 load: GpuLoad | None = None, busy_ms: float = 0.0) -> Row:
    """A warm-up map and unmap, then ``repeats`` timed ones; with ``load``, ``busy_ms`` of
    device work is queued before each repeat and asked after each call whether it still ran."""
    map_, unmap, map_calls, unmap_calls = rig.ops(pages, mode)
    map_()
    unmap()
    row = Row(condition, mode, thread, map_calls, unmap_calls, [], [])
    if load is not None:
        row.busy_before_map, row.busy_after_map, row.busy_after_unmap = [], [], []
    for _ in range(repeats):
        if load is not None and row.busy_before_map is not None:
            load.queue(busy_ms)
            row.busy_before_map.append(load.busy())
        t0 = time.perf_counter_ns()
        map_()
        t1 = time.perf_counter_ns()
        if load is not None and row.busy_after_map is not None:
            row.busy_after_map.append(load.busy())
        t2 = time.perf_counter_ns()
        unmap()
        t3 = time.perf_counter_ns()
        if load is not None and row.busy_after_unmap is not None:
            row.busy_after_unmap.append(load.busy())
            load.drain()
        row.map_us.append((t1 - t0) / len(pages) / 1e3)
        row.unmap_us.append((t3 - t2) / len(pages) / 1e3)
    return row


def in_background(rig: Rig, pages: list[int], mode: str, repeats: int) -> Row:
    """c: a thread of its own times the batches while this thread spins pure Python."""
    out: dict[str, Any] = {}
    done = [False]
    spinning = threading.Event()  # the timing starts once this thread spins, not before

    def work() -> None:
        try:
            spinning.wait()
            out["row"] = time_batches(rig, pages, mode, repeats, "c", "background")
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            out["error"] = exc
        finally:
            done[0] = True

    thread = threading.Thread(target=work, name="map-rate-background", daemon=True)
    thread.start()
    loops = 0
    while not done[0]:
        loops += 1
        if loops == 1:
            spinning.set()
    thread.join(JOIN_S)
    if thread.is_alive():
        raise RuntimeError(f"the background mapping thread did not stop within {JOIN_S:.0f} s")
    if "error" in out:
        raise out["error"]
    row: Row = out["row"]
    row.spinner_loops = loops
    return row


def condition_rows(name: str, rig: Rig, s: Settings, load: GpuLoad | None) -> Iterator[Row]:
    """Condition ``name``'s rows, each as soon as it is timed (a later one may still fail).
    The main thread maps the batch's first kv pages; d's second thread the next ones."""
    main_pages = list(range(s.batch))
    other_pages = list(range(s.batch, 2 * s.batch))
    for mode in (PAGESPACE, PER_RANGE) if name in BOTH_MODES else (PAGESPACE,):
        if name == "a":
            yield time_batches(rig, main_pages, mode, s.repeats, name, "main")
        elif name == "b":
            with Spinner() as spinner:
                row = time_batches(rig, main_pages, mode, s.repeats, name, "main")
            row.spinner_loops = spinner.loops
            yield row
        elif name == "c":
            yield in_background(rig, main_pages, mode, s.repeats)
        elif name == "d":
            with Mapper(rig.space, other_pages) as mapper:
                row = time_batches(rig, main_pages, mode, s.repeats, name, "main")
            row.beside_map_us, row.beside_unmap_us = mapper.map_us, mapper.unmap_us
            yield row
        elif name == "e":
            if load is None:
                raise ValueError("condition e needs the device load")
            yield time_batches(rig, main_pages, mode, s.repeats, name, "main", load, s.gpu_busy_ms)
        else:
            raise ValueError(f"no condition {name!r}; the conditions are {sorted(CONDITIONS)}")


def run(s: Settings) -> Result:
    """Every condition in turn; one that fails is recorded and the next still runs."""
    s.check()
    from kvcached import _vmm

    if s.cuda and not _vmm.cuda_available():
        raise ProbeArgumentError(f"--device {s.device}: no usable CUDA driver and device here")
    start = time.perf_counter()
    saved_interval = sys.getswitchinterval()
    load: GpuLoad | None = None
    result = Result(s)
    rig = Rig.open(s)
    try:
        if s.switch_interval_ms is not None:
            sys.setswitchinterval(s.switch_interval_ms / 1e3)
        result.switch_interval_s = sys.getswitchinterval()
        if s.cuda:
            _vmm.cuda_driver_floor(s.ordinal, s.page_bytes, 8)  # the first pass through the VMM API is slower
            result.floor_us = dict(_vmm.cuda_driver_floor(s.ordinal, s.page_bytes, 64))
            result.device_name, why_not = _cuda_side(s)
            if why_not:
                result.skipped["e"] = why_not
        else:
            result.device_name = "memfd backend"
            result.skipped["e"] = "CUDA only: the CPU backend has no device to keep busy"
        for name in CONDITIONS:
            if name in result.skipped:
                continue
            try:
                if name == "e" and load is None:
                    load = GpuLoad(s.ordinal, s.matmul)
                    result.matmul_ms = load.ms
                for row in condition_rows(name, rig, s, load):
                    result.rows.append(row)
            except Exception as exc:  # noqa: BLE001 - recorded; the other conditions still run
                result.errors[name] = f"{type(exc).__name__}: {exc}"
            result.left_mapped[name] = rig.mapped()
            if result.left_mapped[name]:
                rig.unmap_all()
    finally:
        sys.setswitchinterval(saved_interval)
        try:
            if load is not None:
                load.close()
        finally:
            result.teardown_left_mapped = rig.mapped()
            rig.close()
    result.seconds = time.perf_counter() - start
    return result


def _cuda_side(s: Settings) -> tuple[str, str]:
    """The device's name, and why e cannot run here ('' when it can)."""
    try:
        import torch
    except ImportError:
        return f"cuda:{s.ordinal}", "needs torch (for the side stream's matmuls)"
    if not torch.cuda.is_available():
        return f"cuda:{s.ordinal}", "needs torch with CUDA (for the side stream's matmuls)"
    return torch.cuda.get_device_name(s.ordinal), ""


# ---- the report -----------------------------------------------------------------------------------


def _us(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _spread(samples: Sequence[float]) -> str:
    return f"{_us(min(samples))}-{_us(max(samples))}" if samples else "-"


def _median(samples: Sequence[float]) -> str:
    return _us(statistics.median(samples)) if samples else "-"


def _of(flags: Sequence[bool] | None) -> str:
    return f"{sum(flags)} of {len(flags)}" if flags else ""


def _ratio(samples: Sequence[float], base: Sequence[float] | None) -> str:
    if not samples or not base:
        return "-"
    return f"{statistics.median(samples) / statistics.median(base):.1f}"


def _rows_table(r: Result) -> list[dict[str, str]]:
    s = r.settings
    vmm = s.ranges * s.vmm_pages_per_kv_page
    alone = {row.mode: row for row in r.rows if row.condition == "a"}
    out = []
    if r.floor_us is not None:
        f = r.floor_us
        out.append({"condition": "floor", "timed": "C++", "how": f"raw driver calls x {vmm}",
                    "calls per batch (map / unmap)": f"{3 * vmm * s.batch} / {2 * vmm * s.batch}",
                    "map µs/kv page, median": _us(vmm * (f["create_us"] + f["map_us"] + f["set_access_us"])),
                    "map min-max": "", "unmap µs/kv page, median": _us(vmm * (f["unmap_us"] + f["release_us"])),
                    "unmap min-max": "", "x a (map / unmap)": "", "device busy after (map / unmap)": ""})
    for row in r.rows:
        base = alone.get(row.mode)
        busy = f"{_of(row.busy_after_map)} / {_of(row.busy_after_unmap)}" if row.busy_after_map is not None else ""
        out.append({"condition": row.condition, "timed": row.thread, "how": MODES[row.mode],
                    "calls per batch (map / unmap)": f"{row.map_calls} / {row.unmap_calls}",
                    "map µs/kv page, median": _median(row.map_us), "map min-max": _spread(row.map_us),
                    "unmap µs/kv page, median": _median(row.unmap_us), "unmap min-max": _spread(row.unmap_us),
                    "x a (map / unmap)": f"{_ratio(row.map_us, base.map_us if base else None)} / "
                                         f"{_ratio(row.unmap_us, base.unmap_us if base else None)}",
                    "device busy after (map / unmap)": busy})
    return out


def _beside(r: Result) -> list[str]:
    lines = []
    for row in r.rows:
        if row.spinner_loops is not None:
            who = "the main thread" if row.condition == "c" else "the spinning thread"
            lines.append(f"{row.condition} ({MODES[row.mode]}): {who} looped {row.spinner_loops:,} times")
        if row.beside_map_us is not None and row.beside_unmap_us is not None:
            lines.append(f"{row.condition}: the second thread mapped {len(row.beside_map_us)} timed batches of "
                         f"{r.settings.batch} kv pages (PageSpace), µs per kv page: map {_median(row.beside_map_us)} "
                         f"({_spread(row.beside_map_us)}), unmap {_median(row.beside_unmap_us)} "
                         f"({_spread(row.beside_unmap_us)})")
    if r.matmul_ms is not None:
        lines.append(f"e: one {r.settings.matmul}x{r.settings.matmul} bf16 matmul takes {r.matmul_ms:.2f} ms on the "
                     f"device; about {r.settings.gpu_busy_ms:g} ms of them queued before each repeat")
    return lines


def checks(r: Result) -> dict[str, bool]:
    ran = {row.condition for row in r.rows}
    expected = [c for c in CONDITIONS if c not in r.skipped]
    out = {
        "every condition ran (e only on CUDA)": not r.errors and ran == set(expected) and (r.settings.cuda or
                                                                                            "e" in r.skipped),
        "every timing is positive": bool(r.rows) and all(
            x > 0 for row in r.rows for x in (*row.map_us, *row.unmap_us)) and all(
            len(row.map_us) == len(row.unmap_us) == r.settings.repeats for row in r.rows),
        "every condition left nothing mapped, and so did the teardown": (
            not any(r.left_mapped.values()) and r.teardown_left_mapped == 0),
    }
    busy = [b for row in r.rows for b in row.busy_before_map or ()]
    if busy:  # else the matmuls ran out before the maps began, and e measured an idle device
        out["e: the device was busy when every timed map began"] = all(busy)
    return out


def write(r: Result, out: Path, environment: Provenance, save: bool = True) -> Path:
    """``out`` (the JSON, unless ``save`` is False) and the report beside it (``<stem>.md``, ...)."""
    from serving_probes.probe_report import write_probe_report

    s = r.settings
    interval = f"{r.switch_interval_s * 1e3:g} ms" + (" (set by --switch-interval-ms)"
                                                      if s.switch_interval_ms is not None else "")
    geometry = (f"{s.device} ({r.device_name}): {s.ranges} ranges of {s.range_bytes / MiB:g} MiB, VMM pages of "
                f"{s.page_bytes / MiB:g} MiB, a kv page = {s.vmm_pages_per_kv_page} VMM page(s) per range "
                f"({s.kv_page_bytes / MiB:g} MiB); batches of {s.batch} kv pages, {s.repeats} timed repeats after a "
                f"warm-up; sys.getswitchinterval() {interval}; {r.seconds:.1f} s in all.")
    reading = ("Each row: the map, then the unmap, of one batch timed on the host (perf_counter) on the thread "
               "named, divided by the batch's kv pages; median and min-max over the repeats; x a: the median over "
               "a's median, the same way. "
               + " ".join(f"{k}: {v}." for k, v in CONDITIONS.items())
               + " PageSpace (engine's path): `PageSpace.map_pages` / `unmap_pages`, every range's list of the "
               "batch in one `map_each` / `unmap_each` call that releases the GIL once (its budget charge and "
               "failure undo around it, and an `is_mapped` per VMM page before the unmap); one call per range: "
               "`VirtualRange.map` / `unmap` once per range for the whole batch, the GIL released and retaken at "
               "each, nothing else. Calls per batch count the ranges' maps and unmaps either way. The floor row: "
               "`cuda_driver_floor`'s C++ timing of create + map + set-access (unmap + release) per VMM page, "
               "times the VMM pages of a kv page.")
    notes = [*(f"{c} not run: {why}" for c, why in r.skipped.items()),
             *(f"{c} failed: {why}" for c, why in r.errors.items())]
    sections = [Section("Settings", (Paragraph(geometry),)),
                Section("Map and unmap per kv page", (Paragraph(reading), table(_rows_table(r)))),
                Section("Beside", (Bullets(tuple(_beside(r))),)),
                Section("Not run or failed", (Bullets(tuple(notes)),))]
    data = {"settings": asdict(s), **{k: v for k, v in asdict(r).items() if k != "settings"}}
    return write_probe_report(out.parent, out.stem, "kvcached's map rate per kv page, threads and device competing",
                              environment, data, "`serving_probes/map_rate_probe.py` (its docstring): the engine's "
                              "VirtualRange and PageSpace objects, timed on the host.", sections, checks(r), save)


def result_of(data: dict[str, Any]) -> Result:
    """The `Result` a saved JSON (less its environment block) holds."""
    fields = dict(data)
    settings = Settings(**fields.pop("settings"))
    rows = [Row(**row) for row in fields.pop("rows")]
    return Result(settings, rows, **fields)


def render_saved(data: dict[str, Any], environment: Provenance, out_dir: Path) -> Path:
    """The report of a saved run (``map-rate.json``), rendered again."""
    return write(result_of(data), out_dir / f"{NAME}.json", environment, save=False)


def _environment(s: Settings, argv: Sequence[str], device_name: str) -> Provenance:
    extra: dict[str, object] = {"device": f"{s.device} ({device_name})"}
    if s.cuda:
        extra["cuda driver (cuDriverGetVersion)"] = _driver_version()
        try:
            import torch

            extra["cuda (torch)"] = str(torch.version.cuda)
        except ImportError:
            pass
    return provenance([Path(sys.executable).name, "-m", "serving_probes.map_rate_probe", *argv], extra)


def _driver_version() -> str:
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) != 0:
            return "unknown"
    except OSError:
        return "unknown"
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def byte_size(flag: str) -> Callable[[str], int]:
    """An argparse type for ``flag``: kvcached's own size grammar (`kvcached.config.parse_bytes`:
    ``2MiB``, ``1G``, ``1048576``), its errors as argparse's."""

    def parse(text: str) -> int:
        try:
            return parse_bytes(flag, text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    d = Settings()
    ap = argparse.ArgumentParser(prog="python -m serving_probes.map_rate_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON; the report goes beside it (<stem>.md, ...)")
    ap.add_argument("--render", action="store_true", help="render the report of a saved --out again, running nothing")
    ap.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N (default %(default)s)")
    ap.add_argument("--ranges", type=int, default=d.ranges, help="ranges, one per layer (default %(default)s)")
    ap.add_argument("--range-bytes", type=byte_size("--range-bytes"), default=d.range_bytes, help="each range's size (default 1GiB)")
    ap.add_argument("--page-bytes", type=byte_size("--page-bytes"), default=d.page_bytes, help="the VMM page (default 2MiB)")
    ap.add_argument("--vmm-pages-per-kv-page", type=int, default=d.vmm_pages_per_kv_page,
                    help="VMM pages of each range in a kv page (default %(default)s)")
    ap.add_argument("--batch", type=int, default=d.batch, help="kv pages per timed map (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=d.repeats, help="timed batches per row (default %(default)s)")
    ap.add_argument("--matmul", type=int, default=d.matmul, help="e's bf16 matmul size (default %(default)s)")
    ap.add_argument("--gpu-busy-ms", type=float, default=d.gpu_busy_ms,
                    help="device work queued before each repeat of e (default %(default)s)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval for the run (default: Python's own, 5 ms)")
    args = ap.parse_args(argv)
    if args.render:
        from serving_probes.probe_report import load

        if not args.out.is_file():
            ap.error(f"--render: no saved {args.out}")
        data, environment = load(args.out)
        print(f"report: {write(result_of(data), args.out, environment, save=False)}")
        return 0
    s = Settings(args.device, args.ranges, args.range_bytes, args.page_bytes, args.vmm_pages_per_kv_page,
                 args.batch, args.repeats, args.matmul, args.gpu_busy_ms, args.switch_interval_ms)
    try:
        s.check()
        result = run(s)
    except ConfigError as exc:  # ours, or a range's (a page size the backend refuses)
        ap.error(str(exc))
    md = write(result, args.out, _environment(s, argv, result.device_name))
    for row in _rows_table(result):
        print(f"{row['condition']:>5} {row['timed']:>10} {row['how']:>26}: map {row['map µs/kv page, median']:>8} "
              f"unmap {row['unmap µs/kv page, median']:>8} µs/kv page  {row['device busy after (map / unmap)']}")
    failed = [k for k, ok in checks(result).items() if not ok]
    print(f"report: {md}; {result.seconds:.1f} s" + (f"; checks failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
