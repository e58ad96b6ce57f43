"""Is KV memory behind kvcached's VMM ranges as fast for kernels as plain torch memory?

Two parts, one process, one device:

1. **Bandwidth** (`measure_bandwidth`). The same bytes (default 40 GiB) twice: once in a
   `kvcached._vmm.VirtualRange` of 2 MiB pages, every page mapped before timing and read
   through `kvcached.memory.tensor_view`, once in one ``torch.empty`` (cudaMalloc through
   torch's allocator). Both hold the same random fp16 data, viewed as KV blocks of
   [16 tokens, 8 heads, 128 dim] (32 KiB). Two kernels, timed with CUDA events
   (``time.perf_counter`` on CPU) in alternating rounds (kvcached, torch, kvcached, ...)
   after a warm-up round:

   * *paged gather-reduce*: a random block table (a permutation of every block, cut into
     sequences) gathered and summed per sequence by ``embedding_bag(mode="sum")``, which
     reads every block once and writes only [sequences, block] (no gathered copy);
   * *contiguous sum*: the whole range summed in order (a streaming-read reference).

   Per round, GB/s is the KV bytes read over the median of the round's repetitions; the
   ratio kvcached/torch is taken within a round. Reported: medians over the rounds with
   their min-max, against the device's datasheet peak. Verdict on the per-round ratios
   against ``TARGET_RATIO`` (a lower bound: higher is better) by the project's one rule,
   `conformance.reporting.verdict`, which the benchmarks use too: *inconclusive* when the
   rounds fall on both sides of the target, else *met* or *missed* by the median.

   Checked: the two copies hold identical bytes; the gather-reduce results are bitwise
   identical; a result from a block table that differs by one swapped block differs
   (negative control); after unmapping, closing and releasing torch's caches the device
   free memory is back to its value before the probe (``torch.cuda.mem_get_info``).

2. **Map cost in a decode loop** (`measure_decode`). A `PagePool` over a `PageSpace` of one
   range; a batch of 64 sequences (one 32 KiB block each fills a 2 MiB page) decodes one
   token per step; every 16 steps each starts a new block, so the pool takes one page. Each
   step writes its tokens into the KV (``index_copy_``) and synchronizes. Three reserve
   policies: none; ``min_reserve_pages=2`` (the page taken comes from the reserve, but a
   local `PageSpace` refills the reserve synchronously inside the same ``acquire``); every
   page mapped before the loop. Reported per policy: driver maps (and how many were of the
   page taken), mean µs of ``acquire`` per step and per page-taking call, µs per driver map,
   median step time; every token written is read back at the end.

The probe passes when every check holds, the decode tokens read back, and the paged
gather-reduce's verdict is not *missed* (an *inconclusive* one passes: timing noise is
reported, not failed on).

    python -m serving_probes.bandwidth [--device cuda:0] [--out DIR] [--gib 40]
    python -m serving_probes.bandwidth --device cpu --gib 0.0625      # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from conformance.reporting import (
    Bullets,
    Paragraph,
    Provenance,
    Report,
    Section,
    provenance,
    table,
    verdict,
    write_report,
)
from kvcached import _vmm
from kvcached.config import KvcachedConfig
from kvcached.errors import KvcachedError
from kvcached.memory import tensor_view
from kvcached.pages import PagePool, PageSpace

PAGE = 2 << 20
BLOCK_SHAPE = (16, 8, 128)  # tokens, kv heads, head dim: one K block of a 8-KV-head model
DTYPE = torch.float16
BLOCK_BYTES = 16 * 8 * 128 * 2  # 32 KiB
TOKEN_ELEMS = 8 * 128
TARGET_RATIO = 0.99
#: Datasheet memory bandwidth, bytes/s (NVIDIA H200 SXM: 4.8 TB/s HBM3e; H100 SXM: 3.35 TB/s).
#: torch does not expose the memory clock, so the peak is looked up by device name.
PEAK_BYTES_PER_S = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}
FILL_CHUNK = 1 << 30  # bytes filled, copied or compared per kernel
#: What a part may raise and still let the other part run (torch's device errors are RuntimeErrors).
PROBE_ERRORS = (KvcachedError, RuntimeError, ValueError)


@dataclass(frozen=True)
class KernelRow:
    """One kernel on both sides: medians over the timed rounds, (min, max) beside them."""

    kernel: str
    bytes_read: int
    kvcached_gbps: float
    kvcached_gbps_range: tuple[float, float]
    torch_gbps: float
    torch_gbps_range: tuple[float, float]
    ratio: float  # median of the per-round kvcached/torch ratios
    ratio_range: tuple[float, float]
    kvcached_of_peak: float | None
    torch_of_peak: float | None
    verdict: str


@dataclass(frozen=True)
class BandwidthResult:
    device: str
    bytes_per_side: int
    pages: int
    num_blocks: int
    sequences: int
    rounds: int
    reps: int
    peak_gbps: float | None
    rows: list[KernelRow]
    data_identical: bool
    results_identical: bool  # paged gather-reduce, kvcached vs torch, bitwise
    control_differs: bool  # one swapped block in the table: the comparison must see it
    free_bytes_before: int | None  # None on CPU
    free_bytes_after: int | None

    @property
    def memory_returned(self) -> bool:
        if self.free_bytes_before is None or self.free_bytes_after is None:
            return True
        return self.free_bytes_after >= self.free_bytes_before

    @property
    def passed(self) -> bool:
        return (self.data_identical and self.results_identical and self.control_differs
                and self.memory_returned and all(r.verdict != "missed" for r in self.rows[:1]))


@dataclass(frozen=True)
class DecodeRow:
    policy: str
    steps: int
    steps_per_page: int
    pages_taken: int
    driver_maps: int  # VMM pages the driver mapped during the loop
    driver_maps_per_take: float  # inside the acquire calls that took a page
    taken_page_maps: int  # of those, maps of the very page taken (the rest refill the reserve)
    acquire_us_per_step: float  # all acquire time over all steps
    acquire_us_per_take: float  # mean over the page-taking acquire calls
    driver_us_per_map: float | None
    step_us_median: float  # acquire + token write + synchronize, all steps
    take_step_us_median: float  # the same, steps that took a page only
    tokens_verified: bool


# ---- device helpers ---------------------------------------------------------------------

def _is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def _sync(device: str) -> None:
    if _is_cuda(device):
        torch.cuda.synchronize(torch.device(device))


def _time_s(device: str, fn: Callable[[], object]) -> float:
    """Seconds ``fn``'s device work takes: CUDA events on a GPU, a host clock on CPU."""
    if not _is_cuda(device):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def _free_bytes(device: str) -> int | None:
    if not _is_cuda(device):
        return None
    from serving_probes.torch_caches import release_torch_caches

    release_torch_caches()
    return int(torch.cuda.mem_get_info(torch.device(device))[0])


def _page_size(device: str) -> int:
    if not _is_cuda(device):
        return PAGE
    ordinal = torch.device(device).index or 0
    return max(PAGE, _vmm.cuda_granularity(ordinal))


# ---- data and kernels -------------------------------------------------------------------

def fill_same(kv: torch.Tensor, ref: torch.Tensor, seed: int) -> None:
    """Random normal fp16 into ``kv`` (flat), then the same bytes into ``ref``."""
    gen = torch.Generator(device=kv.device)
    gen.manual_seed(seed)
    step = FILL_CHUNK // kv.element_size()
    for lo in range(0, kv.numel(), step):
        kv[lo:lo + step].normal_(generator=gen)
        ref[lo:lo + step].copy_(kv[lo:lo + step])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two flat tensors of one shape and dtype, a chunk at a time."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    step = FILL_CHUNK // a.element_size()
    return all(torch.equal(a[lo:lo + step], b[lo:lo + step]) for lo in range(0, a.numel(), step))


def block_table(num_blocks: int, sequences: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, offsets): a random permutation of every block, cut into ``sequences``
    runs whose lengths vary by up to ±25% of the mean (so every block is read once)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen)
    mean = num_blocks / sequences
    jitter = (torch.rand(sequences - 1, generator=gen) - 0.5) * 0.5 * mean
    cuts = (torch.arange(1, sequences) * mean + jitter).long().clamp(1, num_blocks - 1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts.sort().values])
    return perm.to(device), offsets.to(device)


def gather_reduce(blocks: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per sequence, the sum of its blocks: [num_blocks, block_elems] -> [sequences, block_elems]."""
    return torch.nn.functional.embedding_bag(indices, blocks, offsets, mode="sum")


def contiguous_sum(flat: torch.Tensor) -> torch.Tensor:
    return flat.sum(dtype=torch.float32)


def swapped_control(indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The table with the first block of the first sequence and the last block of the last
    sequence exchanged: two sequences' sums change, nothing else."""
    control = indices.clone()
    first, last = 0, indices.numel() - 1
    control[first], control[last] = indices[last].clone(), indices[first].clone()
    assert offsets.numel() >= 2 and int(offsets[-1]) > first  # the two sit in different sequences
    return control


# ---- part 1: bandwidth ------------------------------------------------------------------

def _span(values: Sequence[float], digits: int) -> tuple[float, float]:
    return (round(min(values), digits), round(max(values), digits))


def _kernel_row(name: str, nbytes: int, kv_s: list[float], ref_s: list[float],
                peak: float | None) -> KernelRow:
    kv_gbps = [nbytes / t / 1e9 for t in kv_s]
    ref_gbps = [nbytes / t / 1e9 for t in ref_s]
    ratios = [k / r for k, r in zip(kv_gbps, ref_gbps, strict=True)]
    kv_med, ref_med = statistics.median(kv_gbps), statistics.median(ref_gbps)
    return KernelRow(
        name, nbytes, round(kv_med, 1), _span(kv_gbps, 1), round(ref_med, 1), _span(ref_gbps, 1),
        round(statistics.median(ratios), 4), _span(ratios, 4),
        None if peak is None else round(kv_med * 1e9 / peak, 3),
        None if peak is None else round(ref_med * 1e9 / peak, 3),
        verdict(ratios, TARGET_RATIO, higher_is_better=True))


def _time_alternating(device: str, kernels: dict[str, tuple[Callable[[], object], Callable[[], object]]],
                      rounds: int, reps: int) -> dict[str, tuple[list[float], list[float]]]:
    """Per kernel, (kvcached, torch) seconds per timed round: the median of ``reps`` launches.

    One warm-up round first; within a round each kernel runs on kvcached, then on torch.
    """
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in kernels}
    for r in range(rounds + 1):
        for name, sides in kernels.items():
            for side, fn in enumerate(sides):
                t = statistics.median(_time_s(device, fn) for _ in range(reps))
                if r:
                    times[name][side].append(t)
    return times


def _open_range(device: str, nbytes: int, page: int) -> Any:
    vrange = _vmm.VirtualRange(device, nbytes, page)
    try:
        vrange.map(list(range(vrange.num_pages)))
    except BaseException:
        vrange.close()
        raise
    return vrange


def _peak(device: str) -> float | None:
    return PEAK_BYTES_PER_S.get(torch.cuda.get_device_name(torch.device(device))) if _is_cuda(device) else None


@dataclass(frozen=True)
class _Sides:
    rows: list[KernelRow]
    data_identical: bool
    results_identical: bool
    control_differs: bool


def _measure_sides(vrange: Any, sequences: int, rounds: int, reps: int, seed: int) -> _Sides:
    """Fill, check and time both sides; every tensor here dies when this returns."""
    device, nbytes = str(vrange.device), int(vrange.size)
    num_blocks = nbytes // BLOCK_BYTES
    kv = tensor_view(vrange, 0, nbytes, dtype=DTYPE)
    ref = torch.empty(nbytes // kv.element_size(), dtype=DTYPE, device=device)
    fill_same(kv, ref, seed)
    kv_blocks, ref_blocks = kv.view(num_blocks, -1), ref.view(num_blocks, -1)
    indices, offsets = block_table(num_blocks, sequences, seed, device)
    out_ref = gather_reduce(ref_blocks, indices, offsets)
    results_identical = torch.equal(gather_reduce(kv_blocks, indices, offsets), out_ref)
    control = gather_reduce(kv_blocks, swapped_control(indices, offsets), offsets)
    kernels: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "paged gather-reduce (embedding_bag sum)": (lambda: gather_reduce(kv_blocks, indices, offsets),
                                                    lambda: gather_reduce(ref_blocks, indices, offsets)),
        "contiguous sum (stream read)": (lambda: contiguous_sum(kv), lambda: contiguous_sum(ref)),
    }
    times = _time_alternating(device, kernels, rounds, reps)
    rows = [_kernel_row(name, nbytes, *times[name], _peak(device)) for name in times] if rounds else []
    return _Sides(rows, same_bytes(kv, ref), results_identical, not torch.equal(control, out_ref))


def measure_bandwidth(device: str, gib: float, rounds: int = 10, reps: int = 5,
                      sequences: int = 1024, seed: int = 0) -> BandwidthResult:
    """Part 1 (see the module docstring); everything it allocates is freed before it returns.

    ``rounds=0`` fills, checks and runs each kernel once, untimed (a warm-up: every kernel
    is loaded once). Only the first row (the paged gather-reduce) decides `passed`.
    """
    page = _page_size(device)
    nbytes = max(page, int(gib * (1 << 30)) // page * page)
    num_blocks = nbytes // BLOCK_BYTES
    sequences = max(2, min(sequences, num_blocks // 2))
    free_before = _free_bytes(device)
    vrange = _open_range(device, nbytes, page)
    try:
        sides = _measure_sides(vrange, sequences, rounds, reps, seed)
        _sync(device)
        vrange.unmap(vrange.mapped_pages())
    finally:
        vrange.close()
    del vrange
    peak = _peak(device)
    return BandwidthResult(device, nbytes, nbytes // page, num_blocks, sequences, rounds, reps,
                           None if peak is None else peak / 1e9, sides.rows, sides.data_identical,
                           sides.results_identical, sides.control_differs, free_before, _free_bytes(device))


# ---- part 2: map cost in a decode loop --------------------------------------------------

class CountingRange:
    """A `kvcached.pages.Range` that forwards to a VirtualRange and counts its maps."""

    def __init__(self, vrange: Any) -> None:
        self.vrange = vrange
        self.map_calls = self.map_ns = 0
        self.log: list[int] = []  # every page mapped, in order

    @property
    def page_size(self) -> int:
        return int(self.vrange.page_size)

    @property
    def num_pages(self) -> int:
        return int(self.vrange.num_pages)

    @property
    def num_mapped(self) -> int:
        return int(self.vrange.num_mapped)

    def is_mapped(self, page: int) -> bool:
        return bool(self.vrange.is_mapped(page))

    def map(self, pages: Sequence[int]) -> None:
        start = time.perf_counter_ns()
        self.vrange.map(pages)
        self.map_ns += time.perf_counter_ns() - start
        self.map_calls += 1
        self.log.extend(pages)

    def unmap(self, pages: Sequence[int]) -> None:
        self.vrange.unmap(pages)

    def physical_available(self) -> int:
        return int(self.vrange.physical_available())


#: policy -> (min_reserve_pages, max_reserve_pages, map every page before the loop)
POLICIES = {
    "no reserve (min 0, max 0)": (0, 0, False),
    "reserve (min 2, max 4): refilled inside acquire": (2, 4, False),
    "every page mapped before the loop (prefetch)": (0, 1 << 20, True),
}


def decode_loop(device: str, policy: str, steps: int, steps_per_page: int) -> DecodeRow:
    """One decode loop under one reserve policy (see `POLICIES`)."""
    if not 0 < steps_per_page <= BLOCK_SHAPE[0]:
        raise ValueError(f"steps_per_page={steps_per_page}: a block holds {BLOCK_SHAPE[0]} tokens")
    min_reserve, max_reserve, premap = POLICIES[policy]
    page = _page_size(device)
    seqs = page // BLOCK_BYTES  # one new block per sequence per page boundary fills a page
    taken = -(-steps // steps_per_page)
    vrange = _vmm.VirtualRange(device, (taken + min_reserve + 1) * page, page)
    counting = CountingRange(vrange)
    config = KvcachedConfig(page_size=page, min_reserve_pages=min_reserve,
                            max_reserve_pages=min(max_reserve, vrange.num_pages), map_retries=0)
    pool = PagePool(PageSpace((counting,), (1,), vrange.num_pages), config)
    try:
        pool.prefetch(list(range(taken if premap else min_reserve)))
        tokens = tensor_view(vrange, 0, -1, dtype=DTYPE).view(-1, TOKEN_ELEMS)
        row = _run_steps(device, pool, counting, tokens, seqs, steps, steps_per_page)
        del tokens
    finally:
        pool.close()
        vrange.close()
    return DecodeRow(policy, steps, steps_per_page, taken, *row)


def _slots(seqs: int, step: int, steps_per_page: int) -> torch.Tensor:
    """Token slots written at ``step``: sequence s's block on page p is ``p*seqs + s``."""
    page, token = divmod(step, steps_per_page)
    blocks = page * seqs + torch.arange(seqs)
    return blocks * BLOCK_SHAPE[0] + token % BLOCK_SHAPE[0]


def _run_steps(device: str, pool: PagePool, counting: CountingRange, tokens: torch.Tensor,
               seqs: int, steps: int, steps_per_page: int) -> tuple[Any, ...]:
    """The loop; returns `DecodeRow`'s fields after ``pages_taken``."""
    slots = [_slots(seqs, k, steps_per_page).to(device) for k in range(steps)]
    value = torch.empty(seqs, TOKEN_ELEMS, dtype=DTYPE, device=device)
    maps_before, calls_before, ns_before = len(counting.log), counting.map_calls, counting.map_ns
    acquire_ns: list[int] = []
    step_ns: list[int] = []
    taken_page_maps = 0
    for k in range(steps):
        start = time.perf_counter_ns()
        if k % steps_per_page == 0:
            logged = len(counting.log)
            pool.acquire([k // steps_per_page])
            acquire_ns.append(time.perf_counter_ns() - start)
            taken_page_maps += k // steps_per_page in counting.log[logged:]
        value.fill_(float(k % 2048))  # exact in fp16
        tokens.index_copy_(0, slots[k], value)
        _sync(device)
        step_ns.append(time.perf_counter_ns() - start)
    verified = all(bool((tokens[slots[k]] == float(k % 2048)).all()) for k in range(steps))
    maps = len(counting.log) - maps_before
    calls = counting.map_calls - calls_before
    driver_us = (counting.map_ns - ns_before) / calls / 1e3 if calls else None
    return (maps, maps / len(acquire_ns), taken_page_maps, sum(acquire_ns) / steps / 1e3,
            sum(acquire_ns) / len(acquire_ns) / 1e3, None if driver_us is None else round(driver_us, 2),
            statistics.median(step_ns) / 1e3,
            statistics.median(step_ns[::steps_per_page]) / 1e3, verified)


def measure_decode(device: str, steps: int = 1000, steps_per_page: int = 16) -> list[DecodeRow]:
    decode_loop(device, next(iter(POLICIES)), steps_per_page * 2, steps_per_page)  # warm-up
    return [decode_loop(device, policy, steps, steps_per_page) for policy in POLICIES]


# ---- report -----------------------------------------------------------------------------

def environment(device: str, argv: Sequence[str]) -> dict[str, str]:
    """The report's environment block (`conformance.reporting.provenance`), with the device the
    probe ran on and the CUDA runtime torch was built for."""
    extra = {"device": device}
    if _is_cuda(device):
        extra["device name"] = torch.cuda.get_device_name(torch.device(device))
        extra["cuda (torch)"] = str(torch.version.cuda)
    return provenance([Path(sys.executable).name, "-m", "serving_probes.bandwidth", *argv], extra).as_dict()


def bandwidth_rows(result: BandwidthResult) -> list[dict[str, object]]:
    rows = []
    for r in result.rows:
        of_peak = "-" if r.kvcached_of_peak is None else f"{r.kvcached_of_peak:.1%} / {r.torch_of_peak:.1%}"
        rows.append({"kernel": r.kernel, "GiB read": round(r.bytes_read / (1 << 30), 3),
                     "kvcached GB/s (min-max)": f"{r.kvcached_gbps} ({r.kvcached_gbps_range[0]}-"
                                                f"{r.kvcached_gbps_range[1]})",
                     "torch GB/s (min-max)": f"{r.torch_gbps} ({r.torch_gbps_range[0]}-{r.torch_gbps_range[1]})",
                     "of peak kvcached / torch": of_peak,
                     "kvcached/torch (min-max)": f"{r.ratio:.4f} ({r.ratio_range[0]:.4f}-{r.ratio_range[1]:.4f})",
                     "target": f">= {TARGET_RATIO}", "verdict": r.verdict})
    return rows


def checks_rows(result: BandwidthResult) -> list[dict[str, object]]:
    return [{"check": "both copies hold identical bytes", "result": result.data_identical},
            {"check": "gather-reduce results bitwise identical (kvcached vs torch)",
             "result": result.results_identical},
            {"check": "negative control: one swapped block in the table changes the result",
             "result": result.control_differs},
            {"check": "device free memory back to its start (bytes before -> after)",
             "result": f"{result.memory_returned} ({result.free_bytes_before} -> {result.free_bytes_after})"}]


def decode_rows(rows: Sequence[DecodeRow]) -> list[dict[str, object]]:
    return [{"reserve policy": r.policy, "steps": r.steps, "pages taken": r.pages_taken,
             "driver maps": r.driver_maps, "driver maps per page-taking step": round(r.driver_maps_per_take, 2),
             "of which the taken page": r.taken_page_maps,
             "acquire µs per step (mean)": round(r.acquire_us_per_step, 2),
             "acquire µs per page-taking call (mean)": round(r.acquire_us_per_take, 2),
             "µs per driver map call": r.driver_us_per_map,
             "step µs median (all / page-taking)": f"{r.step_us_median:.1f} / {r.take_step_us_median:.1f}",
             "tokens read back": r.tokens_verified} for r in rows]


VERDICT_RULE = ("Ratio: median (min-max) of the per-round kvcached/torch ratios. Verdict (the project's one "
                "rule, `conformance/reporting/verdicts.py`): inconclusive when the per-round ratios fall on both "
                "sides of the target, else met or missed by the median ratio.")


def build(results: dict[str, Any]) -> Report:
    """The probe's report as data, from its results (``results.json``)."""
    body = []
    bw = results.get("bandwidth")
    if bw is not None:
        title = (f"Kernel bandwidth over {bw['bytes_per_side'] / (1 << 30):g} GiB per side "
                 f"({bw['pages']} pages, {bw['num_blocks']} blocks of {BLOCK_BYTES // 1024} KiB, "
                 f"{bw['sequences']} sequences; {bw['rounds']} alternating rounds x {bw['reps']} launches; "
                 f"peak: {bw['peak_gbps'] or 'unknown'} GB/s)")
        body += [Section(title, (table(results["bandwidth_table"]), Paragraph(VERDICT_RULE))),
                 Section("Checks", (table(results["bandwidth_checks"]),))]
    if results.get("decode"):
        every = results["decode"][0]["steps_per_page"]
        body.append(Section(f"Map cost in a decode loop (one page every {every} steps)",
                            (table(results["decode_table"]),)))
    outcome = tuple(f"**{key}**: {results[key]}" for key in ("teardown", "errors", "passed") if key in results)
    body.append(Section("Outcome", (Bullets(outcome),)))
    verdicts = [f"{r['kernel']}: {r['verdict']}" for r in results.get("bandwidth_table", [])]
    return Report(subject="kvcached VMM memory bandwidth against plain torch memory",
                  verdict="PASS" if results.get("passed") else "FAIL",
                  headline="; ".join(verdicts) + "." if verdicts else "No bandwidth measured.",
                  environment=Provenance.from_dict(results["environment"]), body=tuple(body))


def write_outputs(results: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return render_saved(out)


def render_saved(out: Path) -> Path:
    """``report.md`` / ``.html`` / ``.csv`` in ``out`` from its ``results.json``."""
    return write_report(build(json.loads((out / "results.json").read_text())), out)


# ---- entry points -----------------------------------------------------------------------

def run(device: str, gib: float, rounds: int = 10, reps: int = 5, steps: int = 1000,
        argv: Sequence[str] = ()) -> dict[str, Any]:
    """Both parts; a part that raises is recorded in ``errors`` and the other still runs."""
    if _is_cuda(device):
        torch.cuda.set_device(torch.device(device))  # CUDA events and kernels on that device
    results: dict[str, Any] = {"environment": environment(device, argv), "errors": {}}
    try:
        if _is_cuda(device):  # load every kernel once, so lazily loaded modules stay out of the memory check
            measure_bandwidth(device, min(gib, 4.25), rounds=0, reps=1)
        bw = measure_bandwidth(device, gib, rounds, reps)
        results["bandwidth"] = {**dataclasses.asdict(bw), "memory_returned": bw.memory_returned}
        results["bandwidth_table"], results["bandwidth_checks"] = bandwidth_rows(bw), checks_rows(bw)
        ok = bw.passed
    except PROBE_ERRORS as exc:  # reported, and the probe fails
        results["errors"]["bandwidth"] = f"{type(exc).__name__}: {exc}"
        ok = False
    try:
        decode = measure_decode(device, steps)
        results["decode"] = [dataclasses.asdict(r) for r in decode]
        results["decode_table"] = decode_rows(decode)
        ok &= all(r.tokens_verified for r in decode)
    except PROBE_ERRORS as exc:
        results["errors"]["decode"] = f"{type(exc).__name__}: {exc}"
        ok = False
    if _is_cuda(device) and "bandwidth" in results:  # the decode loop gave back its pages too
        start, end = results["bandwidth"]["free_bytes_before"], _free_bytes(device)
        results["teardown"] = {"free_bytes_start": start, "free_bytes_end": end, "returned": end >= start}
        ok &= end >= start
    results["passed"] = ok
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m serving_probes.bandwidth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0", help='"cpu" runs the smoke test')
    ap.add_argument("--out", type=Path, default=Path("reports/gpu/bandwidth"))
    ap.add_argument("--gib", type=float, default=40.0, help="bytes per side, GiB (default 40)")
    ap.add_argument("--rounds", type=int, default=10, help="timed alternating rounds (default 10)")
    ap.add_argument("--reps", type=int, default=5, help="launches per side per round (default 5)")
    ap.add_argument("--steps", type=int, default=1000, help="decode-loop steps (default 1000)")
    ap.add_argument("--render", action="store_true", help="render the report in --out again from its results.json")
    args = ap.parse_args(argv)
    if args.render:
        print(f"report: {render_saved(args.out)}")
        return 0
    results = run(args.device, args.gib, args.rounds, args.reps, args.steps, argv)
    path = write_outputs(results, args.out)
    print(path.read_text())
    print(f"report: {path}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
